"""The reader threads (``automodel.loading.reader``): reads queued to them equal the same reads done at once and
safetensors' own slicing, for dim-0 shards, column bands (rows read past their gaps), cast reads and reads split
into many chunks; the staging pool stays bounded; chunks of short reads are read by one thread at a time, unless
they wait on a disk; the GPU load floors run on the CPU."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from automodel.loading import direct_read, reader
from automodel.loading.checkpoint_files import open_safetensors_file
from automodel.loading.sources import Concatenated, StoredTensor

ROWS, COLUMNS = 64, 48


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "model.safetensors"
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "weight": torch.randn(ROWS, COLUMNS, generator=generator).to(torch.bfloat16),
        "wide": torch.randn(8, 16384, generator=generator),  # rows wider than MAX_GAP: one read per row
        "cube": torch.randn(6, 5, 7, generator=generator),
        "norm": torch.randn(COLUMNS, generator=generator),
    }
    save_file(tensors, path)
    return path, tensors


def _boxes():
    """Dim-0 shards (FSDP2, colwise TP), column bands (rowwise TP), a block of a 3-D tensor, a whole tensor."""
    yield "weight", (slice(16, 32),)
    yield "weight", (slice(0, ROWS), slice(12, 24))
    yield "weight", (slice(3, 40), slice(40, 48))
    yield "wide", (slice(0, 8), slice(1024, 2048))
    yield "cube", (slice(1, 5), slice(2, 4), slice(0, 7))
    yield "cube", (slice(0, 6), slice(1, 4), slice(2, 5))
    yield "norm", (slice(0, COLUMNS),)


@pytest.mark.parametrize("dtype", ["stored", torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [0, 3])
@pytest.mark.parametrize("staging", [direct_read.STAGING_BYTES, 64])
def test_queued_reads_equal_safetensors_slices(stored, monkeypatch, dtype, threads, staging):
    """Same dtype (straight into place) and casts (through the staging pool), one chunk or many (a staging size of
    64 bytes cuts every read into many chunks and long runs into pieces)."""
    monkeypatch.setattr(direct_read, "STAGING_BYTES", staging)
    path, tensors = stored
    files = open_safetensors_file(path)
    outs, expected = [], []
    with safe_open(path, "pt") as handle, reader.parallel_reads("cpu", threads=threads):
        for key, box in _boxes():
            reference = handle.get_slice(key)[box]
            target = reference.dtype if dtype == "stored" else dtype
            out = torch.full(reference.shape, float("nan"), dtype=target)
            assert files.read_into(key, box, out, defer=True)
            outs.append(out)
            expected.append(reference.to(target))
    files.close()
    for out, reference in zip(outs, expected, strict=True):
        assert torch.equal(out, reference)


def test_rows_of_a_column_band_are_read_past_their_gaps(stored):
    """A rowwise TP shard: its rows are one read of their span (gaps into the scratch buffer), counted as such."""
    path, tensors = stored
    files = open_safetensors_file(path)
    out = torch.empty(ROWS, 12, dtype=torch.bfloat16)
    with reader.parallel_reads("cpu", threads=2):
        files.read_into("weight", (slice(0, ROWS), slice(12, 24)), out, defer=True)
    assert torch.equal(out, tensors["weight"][:, 12:24])
    assert files.bytes_read == out.numel() * 2
    assert files.bytes_spanned == ((ROWS - 1) * COLUMNS + 12) * 2  # one span from the first run to the last
    files.close()


def test_wide_rows_are_read_one_by_one(stored):
    """Gaps wider than MAX_GAP are not read past."""
    path, tensors = stored
    files = open_safetensors_file(path)
    out = torch.empty(8, 1024)
    files.read_into("wide", (slice(0, 8), slice(1024, 2048)), out)
    assert torch.equal(out, tensors["wide"][:, 1024:2048])
    assert files.bytes_spanned == files.bytes_read == out.numel() * 4
    files.close()


def test_composite_sources_queue_their_parts(stored):
    """A packed projection (concatenated parts) read into one destination through the queue."""
    path, tensors = stored
    files = open_safetensors_file(path)
    packed = Concatenated(
        [StoredTensor(files, "weight", (ROWS, COLUMNS)), StoredTensor(files, "weight", (ROWS, COLUMNS))], 0
    )
    indices = [torch.arange(ROWS - 8, ROWS + 8), torch.arange(5, 29)]
    out = torch.empty(16, 24, dtype=torch.float32)
    with reader.parallel_reads("cpu", threads=2):
        packed.read_into(indices, out)
    full = torch.cat([tensors["weight"], tensors["weight"]])
    assert torch.equal(out, full[ROWS - 8 : ROWS + 8, 5:29].float())
    files.close()


def test_the_staging_pool_is_bounded_and_reused(stored, monkeypatch):
    """Cast reads of many chunks go through at most one buffer per thread, allocated once and reused."""
    monkeypatch.setattr(direct_read, "STAGING_BYTES", 256)
    reader.release_staging()
    path, tensors = stored
    files = open_safetensors_file(path)
    out = torch.empty(ROWS, COLUMNS)
    with reader.parallel_reads("cpu", threads=2) as reads:
        files.read_into("weight", (slice(0, ROWS),), out, defer=True)
    assert torch.equal(out, tensors["weight"].float())
    assert ROWS * COLUMNS * 2 // 256 > 2  # many chunks ...
    assert reads._pool.allocated_bytes <= 2 * 256  # ... through at most one buffer per thread
    files.close()
    reader.release_staging()


@pytest.mark.parametrize("short", [False, True], ids=["one-read", "short-reads"])
def test_a_failed_read_is_raised_after_every_thread_is_done(stored, short):
    """A read past the end of the file fails in its thread; the block raises it, naming the tensor, once every
    other read is done. The same for a chunk of short reads (read by whichever thread reads those)."""
    path, tensors = stored
    files = open_safetensors_file(path)
    good = torch.empty(ROWS, COLUMNS, dtype=torch.bfloat16)
    bad = torch.empty(32 if short else 16, dtype=torch.uint8)
    end = path.stat().st_size
    with open(path, "rb") as stream:
        if short:  # two reads of 16 bytes, the second past the end
            past_end = direct_read.ReadChunk(stream.fileno(), [0, end], 16, [0, 1], 32, torch.uint8, bad, "'x'")
            assert reader._short_reads(past_end)
        else:
            past_end = direct_read.ReadChunk(stream.fileno(), [end], 16, [0], 16, torch.uint8, bad, "'x'")
        with pytest.raises(OSError, match="Reading 'x' failed: unexpected end of file"):
            with reader.parallel_reads("cpu", threads=2) as reads:
                reads.submit([past_end])
                files.read_into("weight", (slice(0, ROWS),), good, defer=True)
    assert torch.equal(good, tensors["weight"])
    files.close()


def _chunks(path, key, box, fd):
    """The read chunks of ``tensor[box]`` (``key`` in ``path``) into a fresh destination."""
    entry = direct_read.read_header(path).entries[key]
    offsets, length = direct_read.byte_runs(entry, box)
    out = torch.empty(len(offsets) * length, dtype=torch.uint8)
    return direct_read.plan_chunks(fd, offsets, length, torch.uint8, out), out


def test_short_reads_are_the_rows_read_one_by_one(stored):
    """A column band whose rows are read one by one is short reads; a dim-0 shard (one read) and rows read past
    their gaps (one read of the span) are not."""
    path, _ = stored
    with open(path, "rb") as stream:
        rows, _ = _chunks(path, "wide", (slice(0, 8), slice(1024, 2048)), stream.fileno())  # 4 KiB, 60 KiB apart
        shard, _ = _chunks(path, "weight", (slice(16, 32),), stream.fileno())
        spanned, _ = _chunks(path, "weight", (slice(0, ROWS), slice(12, 24)), stream.fileno())
    assert [len(chunk.calls) for chunk in rows] == [8] and reader._short_reads(rows[0])
    assert not reader._short_reads(shard[0]) and not reader._short_reads(spanned[0])
    wide = dataclasses.replace(rows[0], length=reader.SHORT_READ_BYTES, spanned=8 * reader.SHORT_READ_BYTES)
    assert not reader._short_reads(wide)  # reads of SHORT_READ_BYTES each: several threads are faster


def test_short_reads_are_read_by_one_thread_at_a_time(stored, monkeypatch):
    """Chunks of short reads are read one at a time, whatever thread picks them up, while the other threads go on
    with the other chunks: the first chunk of short reads waits in its read until a long read has started, and a
    thread that finds the short reads taken leaves its chunk to the thread reading them (no deadlock, every chunk
    read)."""
    monkeypatch.setattr(reader, "SHORT_READ_WAIT_SECONDS", float("inf"))  # however long they take here
    path, tensors = stored
    long_started = threading.Event()
    active, most = [0], [0]
    lock = threading.Lock()
    read_chunk = reader.read_chunk

    def observed(chunk, target):
        if reader._short_reads(chunk):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            assert long_started.wait(timeout=30), "no long read started while short reads were being read"
            time.sleep(0.002)
            read_chunk(chunk, target)
            with lock:
                active[0] -= 1
        else:
            long_started.set()
            read_chunk(chunk, target)

    monkeypatch.setattr(reader, "read_chunk", observed)
    box = (slice(0, 8), slice(1024, 2048))
    with open(path, "rb") as stream:
        short = [_chunks(path, "wide", box, stream.fileno()) for _ in range(6)]
        long, long_out = _chunks(path, "weight", (slice(0, ROWS),), stream.fileno())
        with reader.parallel_reads("cpu", threads=3) as reads:
            for chunks, _ in short[:3]:
                reads.submit(chunks)
            reads.submit(long)
            for chunks, _ in short[3:]:
                reads.submit(chunks)
    assert most[0] == 1
    for _, out in short:
        assert torch.equal(out.view(torch.float32).view(8, 1024), tensors["wide"][box])
    assert torch.equal(long_out.view(torch.bfloat16).view(ROWS, COLUMNS), tensors["weight"])


def test_short_reads_that_wait_on_a_disk_are_read_by_every_thread(stored, monkeypatch):
    """Once a chunk of short reads took longer than ``SHORT_READ_WAIT_SECONDS`` a call, the next ones are read by
    every thread at once (two of them meet inside their reads); once one is quick again, they go back to one thread."""
    monkeypatch.setattr(reader, "SHORT_READ_WAIT_SECONDS", 0.0)  # every read waits on the disk
    path, tensors = stored
    meeting = threading.Barrier(2, timeout=30)
    read_chunk = reader.read_chunk
    waiting = []

    def observed(chunk, target):
        if waiting:
            meeting.wait()  # broken (an error) unless another thread reads a chunk of short reads meanwhile
        read_chunk(chunk, target)

    monkeypatch.setattr(reader, "read_chunk", observed)
    box = (slice(0, 8), slice(1024, 2048))
    with open(path, "rb") as stream:
        chunks = [_chunks(path, "wide", box, stream.fileno()) for _ in range(4)]
        with reader.parallel_reads("cpu", threads=3) as reads:
            reads.submit(chunks[0][0])  # read by one thread, and found to wait
            deadline = time.monotonic() + 30
            while not reads._short_reads_wait and time.monotonic() < deadline:
                time.sleep(0.001)
            assert reads._short_reads_wait
            waiting.append(True)
            reads.submit(chunks[1][0])
            reads.submit(chunks[2][0])
            reads.finish()
            waiting.clear()
            monkeypatch.setattr(reader, "SHORT_READ_WAIT_SECONDS", float("inf"))
            reads.submit(chunks[3][0])  # quick: the next ones go to one thread again
        assert not reads._short_reads_wait
    for _, out in chunks:
        assert torch.equal(out.view(torch.float32).view(8, 1024), tensors["wide"][box])


def test_floor_seconds_on_the_cpu(stored):
    path, _ = stored
    floors = reader.floor_seconds([path], "cpu", threads=2)
    assert set(floors) == {"read_pinned_s", "h2d_s", "bytes"}
    assert floors["bytes"] == path.stat().st_size and floors["read_pinned_s"] >= 0 and floors["h2d_s"] >= 0


@pytest.mark.parametrize(
    ("machine", "bound_to", "local_ranks", "expected"),
    [
        (16, 16, None, 8),  # one process, not bound: one thread per core, at most MAX_READER_THREADS
        (16, 16, "4", 4),  # the node's cores shared among its ranks
        (16, 16, "8", 2),
        (16, 16, "16", 0),  # one core per rank: the reads in the thread that plans them
        (2, 2, "4", 0),  # more ranks than cores: the same
        (96, 1, "8", 0),  # bound to one core
        (96, 6, "8", 6),  # a rank bound to 6 cores (torchrun --numa-binding, taskset) has those to itself
    ],
)
def test_default_reader_threads_share_the_cores_among_the_ranks(monkeypatch, machine, bound_to, local_ranks, expected):
    monkeypatch.delenv("AUTOMODEL_READER_THREADS", raising=False)
    monkeypatch.setattr(reader.os, "cpu_count", lambda: machine)
    monkeypatch.setattr(reader.os, "sched_getaffinity", lambda pid: set(range(bound_to)), raising=False)
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert reader.default_reader_threads() == expected
    monkeypatch.setenv("AUTOMODEL_READER_THREADS", "3")  # set: taken as it is
    assert reader.default_reader_threads() == 3
    assert reader.ParallelReader("cpu").threads == 3
    monkeypatch.setenv("AUTOMODEL_READER_THREADS", "0")  # 0: the default
    assert reader.default_reader_threads() == expected
    for wrong in ("-2", "four"):
        monkeypatch.setenv("AUTOMODEL_READER_THREADS", wrong)
        with pytest.raises(ValueError, match="AUTOMODEL_READER_THREADS"):
            reader.default_reader_threads()
