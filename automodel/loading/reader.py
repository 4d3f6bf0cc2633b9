"""The reader threads that fill a model's local shards from the checkpoint files.

The loader plans every read first (``direct_read.plan_chunks``: byte runs of one file, at most ``STAGING_BYTES``
each) and hands the chunks to a few reader threads as it goes, so the next tensor is planned while the last ones are
read (``preadv`` and the copies release the GIL). A chunk for host memory of the stored dtype is read straight into
the parameter's storage. Any other goes through a staging buffer taken from a small pool of reused buffers: on the
host it is cast into place; for an accelerator the buffer is pinned and copied to the device with
``non_blocking=True`` on a side stream, an event recorded after the copy, and the buffer goes back to the pool while
the thread reads its next chunk. A buffer is reused only once its own copy is done (its event), nothing else waits,
and the one synchronisation is at the end. Host memory beyond the shards: the pool (two buffers per thread on an
accelerator, at most one per thread on the host, and none when every read goes straight to its place).

Chunks of short reads (the rows of a column band, one ``preadv`` each) are read by one thread at a time, while the
others go on with the rest. A ``preadv`` of a few KiB from the page cache takes about a microsecond, so threads that
each make such calls spend their time handing the GIL to each other: two threads read them more slowly than one (see
:data:`SHORT_READ_BYTES`). Short reads that wait on a disk are read by every thread at once, so that the waits
overlap: each chunk of short reads is timed, and the next ones go to one thread only while they took less than
:data:`SHORT_READ_WAIT_SECONDS` a call.

CUDA is touched only when a destination is on a CUDA device (pinned buffers, the stream, events), so all of this runs
and is tested on the CPU, where the same threads serve the copying path.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path

import torch

from . import direct_read
from .direct_read import ReadChunk, plan_chunks, read_chunk

__all__ = [
    "MAX_READER_THREADS",
    "SHORT_READ_BYTES",
    "SHORT_READ_WAIT_SECONDS",
    "ParallelReader",
    "StagingPool",
    "default_reader_threads",
    "floor_seconds",
    "parallel_reads",
    "read_runs",
    "release_staging",
]

#: The most reader threads a process starts by default. Several reads in flight keep a fast disk or the page cache
#: busy while one thread waits in a copy (on an H200 node, 4.3 GB into pinned buffers: 15-18 GB/s with 4 threads,
#: 22-28 GB/s with 8); more only contend for the same memory bandwidth.
MAX_READER_THREADS = 8

#: A chunk whose system calls read less than this each, on average, is a chunk of short reads: one thread at a time
#: reads those. Measured on the 2-core test machine (``preadv`` per run, runs at twice their length apart, page cache
#: warm): 2 KiB runs take 1.0 us each with one thread and 1.6 us with two, 8 KiB runs 2.4 and 3.0 us, 32 KiB runs 7.1
#: and 5.6 us (two threads are faster from there on). A 70B rank under FSDP2 x TP=8 reads 164k rows of 2 and 7 KiB
#: (``o_proj``, ``down_proj``): its load from a cold page cache fell from 1.55-1.62 s to 1.32-1.34 s, against
#: 1.07-1.11 s for the same rank under FSDP2 alone (docs/performance.md, "Short reads in one thread").
SHORT_READ_BYTES = 16 << 10
#: Short reads that took longer than this a call, on average over their chunk, waited on a disk: the next ones are
#: read by every thread at once, so that the waits overlap. Measured per call (one rank, two threads): 2-8 KiB rows
#: from the page cache or a sparse file 2.5-8.2 us (10th to 90th percentile of the chunks), the 8 KiB rows of a 3B
#: checkpoint under TP=2 from a cold page cache on the machine's disk 21-162 us; that load took 3.9 s with its short
#: reads in one thread and 2.8 s with them in both.
SHORT_READ_WAIT_SECONDS = 20e-6


def default_reader_threads() -> int:
    """Reader threads for this process: ``AUTOMODEL_READER_THREADS`` when set (0: as if unset), else one per core
    this rank has to itself, up to :data:`MAX_READER_THREADS`, and none (0: the thread that plans the reads does them)
    where the rank has less than two cores to itself.

    A rank's cores are those it may run on (``sched_getaffinity``) when it is bound to fewer than the machine's,
    else the machine's shared among the node's ranks (``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it): 8 ranks on a
    16-core node start 2 each, not 8 each for 16 cores. Threads beyond a rank's cores take turns on them with the
    other ranks' threads. Where each rank has 8 cores or more (one GPU process on an H200 node) the count is 8.

    With less than two cores a reader thread cannot run beside the thread that plans the reads, and every chunk
    handed to it costs a switch of thread and of the GIL: on the 2-core test machine, rank 0 of 4 re-reading its
    303 MiB of a 1.27 GB Llama (the memory already faulted in, so that only the copies and the handing over are left)
    took 61-85 ms of CPU with one reader thread and 48-57 ms reading in the calling thread. The reads stay in order
    and double-buffered for a device either way (:class:`ParallelReader`).
    """
    configured = os.environ.get("AUTOMODEL_READER_THREADS", "").strip()
    if configured not in ("", "0"):
        if not configured.isdigit():
            raise ValueError(
                f"AUTOMODEL_READER_THREADS={configured!r}: give a number of reader threads (1 or more), or unset it "
                "(or 0) for one per core of this rank."
            )
        return int(configured)
    machine = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    if usable >= machine:  # not bound to a part of the machine: share it with the node's other ranks
        usable //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return min(MAX_READER_THREADS, usable) if usable >= 2 else 0


_ACTIVE: ContextVar[ParallelReader | None] = ContextVar("automodel_active_reader", default=None)


class StagingPool:
    """Reused staging buffers of ``STAGING_BYTES`` (pinned host memory when ``pinned``), allocated on first use. A
    buffer is handed out only after the device copy recorded on it (its event) is done."""

    def __init__(self, count: int, pinned: bool, nbytes: int) -> None:
        self.count = count
        self.pinned = pinned
        self.nbytes = nbytes
        # First in, first out: the buffer given back longest ago is the one whose copy is most likely done.
        self._free: queue.Queue[tuple[torch.Tensor, object | None]] = queue.Queue()
        self._allocated = 0
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """A free buffer whose last copy has finished (allocated when none is free and fewer than ``count`` exist)."""
        with self._lock:
            if self._free.empty() and self._allocated < self.count:
                self._allocated += 1
                return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        buffer, event = self._free.get()
        if event is not None:
            event.synchronize()
        return buffer

    def give(self, buffer: torch.Tensor, event: object | None = None) -> None:
        """Return ``buffer``; ``event`` marks the end of the copy still reading from it."""
        self._free.put((buffer, event))

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds."""
        return self._allocated * self.nbytes


_POOLS: dict[tuple[bool, int, int], StagingPool] = {}
_EXECUTORS: dict[int, ThreadPoolExecutor] = {}


def _pool(pinned: bool, count: int) -> StagingPool:
    """The process's pool for this kind of buffer: reused across loads (fresh buffers cost a page fault per 4 KiB,
    pinned ones a slow registration with the driver)."""
    key = (pinned, count, direct_read.STAGING_BYTES)
    if key not in _POOLS:
        _POOLS[key] = StagingPool(count, pinned, direct_read.STAGING_BYTES)
    return _POOLS[key]


def release_staging() -> None:
    """Free the staging buffers kept for later loads (pinned memory included)."""
    _POOLS.clear()


def _executor(threads: int) -> ThreadPoolExecutor:
    if threads not in _EXECUTORS:
        _EXECUTORS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="automodel-read")
    return _EXECUTORS[threads]


class ParallelReader:
    """Reads chunks with ``threads`` reader threads (0: in the calling thread, as they are submitted; ``None``:
    :func:`default_reader_threads`) into destinations on ``device`` (see the module docstring). :meth:`finish` waits
    for every read and copy."""

    def __init__(self, device: torch.device | str, threads: int | None = None) -> None:
        threads = default_reader_threads() if threads is None else threads
        self.device = torch.device(device)
        self.threads = threads
        self._futures: list[Future] = []
        self._stream = None
        # Chunks of short reads wait here for the one thread that reads them (the holder of the lock), unless the
        # last chunk of short reads waited on a disk.
        self._short: queue.SimpleQueue[ReadChunk] = queue.SimpleQueue()
        self._short_lock = threading.Lock()
        self._short_reads_wait = False
        cuda = self.device.type == "cuda"
        self._pool = _pool(cuda, 2 * max(threads, 1) if cuda else max(threads, 1))
        if cuda:
            self._stream = torch.cuda.Stream(self.device)
            # Destinations may still be written on the current stream (FSDP2 pads its shards there).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def submit(self, chunks: Sequence[ReadChunk]) -> None:
        """Queue ``chunks`` (run them now without threads)."""
        if self.threads == 0:
            for chunk in chunks:
                self._run(chunk)
            return
        executor = _executor(self.threads)
        self._futures.extend(executor.submit(self._run, chunk) for chunk in chunks)

    def finish(self) -> None:
        """Wait for every read and device copy; raise the first failure (after all threads are done with their
        destinations)."""
        futures, self._futures = self._futures, []
        errors = [error for error in (future.exception() for future in futures) if error is not None]
        if self._stream is not None:
            self._stream.synchronize()
        if errors:
            raise errors[0]

    def _run(self, chunk: ReadChunk) -> None:
        if not _short_reads(chunk):
            self._read(chunk)
            return
        if self._short_reads_wait:  # on a disk: in this thread, beside the other threads' short reads
            self._read_short(chunk)
            return
        # Queue it; if no other thread is reading short reads, read every queued one. A thread that finds the lock
        # held goes back to its other chunks: the holder reads this one too. The holder looks at the queue again
        # after letting go of the lock, so a chunk queued while it held the lock is not left behind.
        self._short.put(chunk)
        while not self._short.empty() and self._short_lock.acquire(blocking=False):
            try:
                self._read_queued_short()
            finally:
                self._short_lock.release()

    def _read_queued_short(self) -> None:
        """Read the queued chunks of short reads until none is left (the caller holds the lock)."""
        while True:
            try:
                queued = self._short.get_nowait()
            except queue.Empty:
                return
            self._read_short(queued)

    def _read_short(self, chunk: ReadChunk) -> None:
        """Read a chunk of short reads, and note whether they waited on a disk."""
        start = time.perf_counter()
        self._read(chunk)
        self._short_reads_wait = time.perf_counter() - start > SHORT_READ_WAIT_SECONDS * len(chunk.calls)

    def _read(self, chunk: ReadChunk) -> None:
        try:
            if chunk.direct:
                read_chunk(chunk, _host_bytes(chunk.out))
                return
            buffer = self._pool.take()
            event = None
            try:
                staged = buffer[: chunk.nbytes]
                read_chunk(chunk, _host_bytes(staged))
                event = self._deliver(chunk, staged)
            finally:
                self._pool.give(buffer, event)
        except OSError as error:
            raise OSError(f"Reading {chunk.what} failed: {error}") from error

    def _deliver(self, chunk: ReadChunk, staged: torch.Tensor) -> object | None:
        """Copy the staged bytes to ``chunk.out`` (cast where the dtypes differ); an event after a device copy."""
        out = chunk.out
        if out.device.type == "cpu" or self._stream is None:
            out.copy_(staged.view(chunk.dtype))
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if out.dtype == chunk.dtype:
                out.view(torch.uint8).copy_(staged, non_blocking=True)
            else:  # cast on the device: a host-side cast would be a synchronous pageable copy
                out.copy_(staged.to(self.device, non_blocking=True).view(chunk.dtype))
            event = torch.cuda.Event()
            event.record(self._stream)
        return event


def _short_reads(chunk: ReadChunk) -> bool:
    """Whether ``chunk`` is several system calls of less than :data:`SHORT_READ_BYTES` each on average."""
    calls = len(chunk.calls)
    return calls > 1 and chunk.spanned < calls * SHORT_READ_BYTES


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().view(torch.uint8).numpy())


@contextlib.contextmanager
def parallel_reads(device: torch.device | str, threads: int | None = None) -> Iterator[ParallelReader]:
    """Within the block, safetensors reads into final destinations (``read_runs(..., defer=True)``) go to one
    :class:`ParallelReader` with ``threads`` reader threads (default :func:`default_reader_threads`); they are all
    done, and their device copies too, when the block exits."""
    reader = ParallelReader(device, threads)
    token = _ACTIVE.set(reader)
    try:
        yield reader
    except BaseException:
        with contextlib.suppress(Exception):
            reader.finish()  # no thread may still write into memory the caller is about to drop
        raise
    finally:
        _ACTIVE.reset(token)
    reader.finish()


def read_runs(
    fd: int,
    offsets: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    out: torch.Tensor,
    *,
    what: str = "",
    defer: bool = False,
) -> int:
    """Fill the contiguous ``out`` (host or device) with the byte runs at ``offsets`` (ascending, each ``length``
    bytes of ``dtype``, in order), cast where ``out``'s dtype differs. With ``defer`` and a :func:`parallel_reads`
    block active, the reads are queued to its threads (``out`` must then stay untouched until the block exits);
    otherwise they are done before this returns. Returns the bytes read from the file (gaps read past included)."""
    chunks = plan_chunks(fd, offsets, length, dtype, out, what)
    reader = _ACTIVE.get() if defer else None
    if reader is not None:
        reader.submit(chunks)
    else:
        with parallel_reads(out.device, threads=0) as now:
            now.submit(chunks)
    return sum(chunk.spanned for chunk in chunks)


def floor_seconds(files: Sequence[str | Path], device: torch.device | str, threads: int | None = None) -> dict:
    """The two floors of loading ``files`` onto ``device``, timed with the loader's own machinery:

    - ``read_pinned_s``: every byte of the files read by ``threads`` reader threads (default
      :func:`default_reader_threads`) into the reused staging buffers (pinned host memory for CUDA, ordinary memory
      otherwise), in ``direct_read.STAGING_BYTES`` pieces;
    - ``h2d_s``: the same number of bytes copied from those staging buffers to ``device`` (``non_blocking`` on a
      side stream, one synchronisation at the end; into ordinary host memory for the CPU), into a destination of
      at most 1 GiB reused in turn.

    Also returns ``bytes`` (the files' total size). The files should be in the page cache for a warm floor.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    threads = default_reader_threads() if threads is None else threads
    pool = _pool(cuda, 2 * max(threads, 1) if cuda else max(threads, 1))
    pieces: list[tuple[int, int, int]] = []  # (fd, offset, size)
    descriptors = [os.open(path, os.O_RDONLY) for path in files]
    try:
        for fd, path in zip(descriptors, files, strict=True):
            size = os.path.getsize(path)
            step = direct_read.STAGING_BYTES
            pieces += [(fd, start, min(step, size - start)) for start in range(0, size, step)]
        total = sum(size for _, _, size in pieces)
        buffers = [pool.take() for _ in range(pool.count)]
        for buffer in buffers:
            pool.give(buffer)

        def read_piece(piece: tuple[int, int, int]) -> None:
            fd, offset, size = piece
            buffer = pool.take()
            try:
                chunk = ReadChunk(fd, [offset], size, [0], size, torch.uint8, buffer[:size], "floor")
                read_chunk(chunk, _host_bytes(buffer[:size]))
            finally:
                pool.give(buffer)

        start = time.perf_counter()
        list(_executor(max(threads, 1)).map(read_piece, pieces))
        read_seconds = time.perf_counter() - start
    finally:
        for fd in descriptors:
            os.close(fd)
    destination = torch.empty(min(total, 1 << 30), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device) if cuda else None
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        position = 0
        for index, (_, _, size) in enumerate(pieces):
            if position + size > destination.numel():
                position = 0
            destination[position : position + size].copy_(buffers[index % len(buffers)][:size], non_blocking=cuda)
            position += size
    if cuda:
        stream.synchronize()
    return {"read_pinned_s": read_seconds, "h2d_s": time.perf_counter() - start, "bytes": total}
