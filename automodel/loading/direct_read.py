"""Read a box of a safetensors tensor (one ``[start, stop)`` range per dim) as the byte runs it is made of, with
positioned reads (``os.preadv``), cut into chunks that reader threads take one at a time (``reader``).

Why not ``safe_open(...).get_slice``: its slices are views of a memory map, so copying them into a parameter keeps
both the mapped file pages and the copy resident during the load (about twice the shard size of host memory) and costs
a page fault per 4 KiB twice. For a box that is not contiguous in the file it is worse: a dim-1 shard (a rowwise TP
weight) touches the pages of its whole row band, TP times its own bytes (3.75x the local shards in host memory for a
70B model under FSDP2 x TP=8). Here each run lands straight in its place: in the parameter's storage when it is host
memory of the stored dtype, else in a bounded staging buffer that is then cast or copied to the device. Runs close
together (the rows of a column band) are one ``preadv`` with many buffers, the gaps between them read into a scratch
buffer: one system call per block of rows, no copy out of a staging buffer, host memory the local shard plus the
scratch.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "MAX_GAP",
    "SAFETENSORS_DTYPES",
    "SPAN_AMPLIFICATION",
    "STAGING_BYTES",
    "ReadChunk",
    "SafetensorsHeader",
    "byte_runs",
    "plan_chunks",
    "read_chunk",
    "read_header",
    "read_into",
    "spanned_bytes",
]

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    # E8M0 block exponents (MXFP8 scales); absent from older torch builds.
    **({"F8_E8M0": torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {}),
}
_MAX_READ = 1 << 30  # preadv moves at most ~2 GiB per call on Linux


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in its file."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its first element


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one safetensors file."""

    entries: dict[str, TensorEntry]
    expected_size: int  # bytes the header says the file holds


def read_header(path: Path) -> SafetensorsHeader:
    """Parse the JSON header (8-byte little-endian length, then JSON) of a safetensors file."""
    with open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
    data_start = 8 + length
    entries, end = {}, 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        end = max(end, stop)
        entries[key] = TensorEntry(SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(entry["shape"]), data_start + begin)
    return SafetensorsHeader(entries, data_start + end)


def byte_runs(entry: TensorEntry, slices: tuple[slice, ...]) -> tuple[torch.Tensor, int] | None:
    """The file offsets of the contiguous byte runs ``tensor[slices]`` is made of, in row-major order, and their
    common length in bytes (``None`` for a dtype safetensors names that this torch lacks)."""
    if entry.dtype is None:
        return None
    shape = entry.shape
    bounds = [(s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(slices)]
    bounds += [(0, size) for size in shape[len(bounds) :]]
    element = entry.dtype.itemsize
    strides = [element] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    if not shape:  # a 0-d tensor: one element
        return torch.tensor([entry.start], dtype=torch.int64), element
    if any(hi <= lo for lo, hi in bounds):
        return torch.zeros(0, dtype=torch.int64), 0
    # A run spans the last dim that is not taken whole (and every dim after it); the dims before it index the runs.
    partial = max((d for d, (lo, hi) in enumerate(bounds) if hi - lo != shape[d]), default=0)
    lo, hi = bounds[partial]
    length = (hi - lo) * strides[partial]
    offsets = torch.tensor([entry.start + lo * strides[partial]], dtype=torch.int64)
    for d in range(partial - 1, -1, -1):
        lo, hi = bounds[d]
        offsets = (torch.arange(lo, hi, dtype=torch.int64) * strides[d]).unsqueeze(1) + offsets.unsqueeze(0)
        offsets = offsets.flatten()
    return offsets, length


#: The most one read chunk moves: a reader thread's unit of work, and the size of a staging buffer (a cast read, or
#: any read for an accelerator, goes through one; a read of the same dtype into host memory goes straight to its place).
STAGING_BYTES = 16 << 20
#: Short runs close together (a dim-1 shard's rows) are read by one ``preadv`` whose gaps land in a scratch buffer,
#: when a gap is at most ``SPAN_AMPLIFICATION - 1`` times the run and at most ``MAX_GAP`` bytes (a page). With the
#: page cache warm, a ``preadv`` per row costs 1.1-2.4 us and reading past a gap 0.12 us more per KiB of gap, so the
#: two are even at about 8 KiB; with it cold, each page read past is one more page to fill. A 70B ``o_proj`` row under
#: TP=8 (2 KiB of 16 KiB) is read alone: read past its gaps, one rank pulled 1.1 GB more through the page cache for
#: its 2.1 GB (docs/performance.md, "Loading a TP rank from a cold page cache").
SPAN_AMPLIFICATION = 16
MAX_GAP = 4 << 10
_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv


@dataclass(frozen=True)
class ReadChunk:
    """One unit of a reader's work: runs of ``length`` bytes at ``offsets`` (ascending) in one file, whose bytes are
    ``out``'s elements back to back (``out`` is flat and contiguous, in host memory or on an accelerator; ``dtype``
    is the stored dtype, cast on the way where ``out``'s differs). Each index of ``calls`` starts one ``preadv``
    that reads the runs up to the next one, the gaps between them included (``spanned`` bytes in all). ``what``
    names the tensor and file for errors."""

    fd: int
    offsets: list[int]
    length: int
    calls: list[int]
    spanned: int
    dtype: torch.dtype
    out: torch.Tensor
    what: str = ""

    @property
    def nbytes(self) -> int:
        """The bytes of the runs (what ``out`` receives, before a cast)."""
        return len(self.offsets) * self.length

    @property
    def direct(self) -> bool:
        """Whether the runs can be read straight into ``out`` (host memory of the stored dtype)."""
        return self.out.device.type == "cpu" and self.out.dtype == self.dtype


def plan_chunks(
    fd: int, offsets: torch.Tensor, length: int, dtype: torch.dtype, out: torch.Tensor, what: str = ""
) -> list[ReadChunk]:
    """The byte runs at ``offsets`` (ascending, ``length`` bytes each of ``dtype``) cut into chunks of at most
    ``STAGING_BYTES`` (a longer run into pieces, at element bounds) and ``_IOV_MAX // 2`` runs, each with its part of
    the contiguous ``out``. Computed with tensor ops: a column band of a large weight is thousands of runs."""
    if length == 0 or len(offsets) == 0:
        return []
    element = dtype.itemsize
    limit = max(element, STAGING_BYTES // element * element)
    target = out.detach().reshape(-1)
    if length > limit:  # each run in pieces, one chunk each
        chunks, position = [], 0
        for offset in offsets.tolist():
            for start in range(0, length, limit):
                size = min(limit, length - start)
                part = target[position : position + size // element]
                chunks.append(ReadChunk(fd, [offset + start], size, [0], size, dtype, part, what))
                position += size // element
        return chunks
    count = len(offsets)
    if count == 1:  # one run (a dim-0 shard, a whole tensor): one chunk, nothing to plan
        return [ReadChunk(fd, [int(offsets[0])], length, [0], length, dtype, target, what)]
    per_chunk = max(1, min(_IOV_MAX // 2, limit // length))
    gaps = offsets[1:] - offsets[:-1] - length
    starts = torch.ones(count, dtype=torch.bool)
    starts[1:] = (gaps < 0) | (gaps > min(MAX_GAP, (SPAN_AMPLIFICATION - 1) * length))
    starts[::per_chunk] = True
    # Bytes read past inside calls, cumulated: a chunk's span is its runs plus the difference at its ends.
    read_past = torch.zeros(count, dtype=torch.int64)
    read_past[1:] = torch.where(starts[1:], 0, gaps).cumsum(0)
    past = read_past.tolist()
    call_starts = torch.nonzero(starts).flatten().tolist()
    flat = offsets.tolist()
    chunks = []
    per_run = length // element
    for first in range(0, count, per_chunk):
        last = min(count, first + per_chunk)
        lo, hi = bisect.bisect_left(call_starts, first), bisect.bisect_left(call_starts, last)
        calls = list(range(last - first)) if hi - lo == last - first else [c - first for c in call_starts[lo:hi]]
        spanned = (last - first) * length + past[last - 1] - past[first]
        part = target[first * per_run : last * per_run]
        chunks.append(ReadChunk(fd, flat[first:last], length, calls, spanned, dtype, part, what))
    return chunks


def read_chunk(chunk: ReadChunk, target: memoryview) -> None:
    """Read ``chunk``'s runs back to back into ``target`` (``chunk.nbytes`` bytes of host memory): one ``preadv``
    per call, the gaps inside it read into a scratch buffer nobody reads."""
    offsets, length, fd = chunk.offsets, chunk.length, chunk.fd
    if len(chunk.calls) == len(offsets):  # no gap read past: one read per run (wide rows, or one run)
        for index, offset in enumerate(offsets):
            _preadv_all(fd, [target[index * length : (index + 1) * length]], offset, length)
        return
    ends = [*chunk.calls[1:], len(offsets)]
    for first, last in zip(chunk.calls, ends, strict=True):
        views = [target[index * length : (index + 1) * length] for index in range(first, last)]
        span = offsets[last - 1] + length - offsets[first]
        stride = offsets[first + 1] - offsets[first] if last - first > 1 else length
        if stride == length:  # adjacent runs: one buffer
            buffers = [target[first * length : last * length]]
        elif span == (last - first - 1) * stride + length:  # evenly spaced: the rows of a box
            buffers = [_scratch(stride - length)] * (2 * len(views) - 1)
            buffers[::2] = views
        else:
            buffers = [views[0]]
            for index in range(first + 1, last):
                gap = offsets[index] - offsets[index - 1] - length
                if gap:
                    buffers.append(_scratch(gap))
                buffers.append(views[index - first])
        _preadv_all(fd, buffers, offsets[first], span)


def spanned_bytes(offsets: torch.Tensor, length: int) -> int:
    """The bytes :func:`read_chunk` reads from the file for these runs (the gaps read past included)."""
    if length == 0 or len(offsets) == 0:
        return 0
    probe = torch.empty(len(offsets) * length, dtype=torch.uint8, device="meta")
    return sum(chunk.spanned for chunk in plan_chunks(-1, offsets, length, torch.uint8, probe))


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, total: int) -> None:
    """``preadv`` until every buffer (``total`` bytes together) is full: a read may stop short."""
    count = os.preadv(fd, buffers, offset)
    if count == total:
        return
    index = 0
    while True:
        if count <= 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        offset, total = offset + count, total - count
        if total == 0:
            return
        while count >= buffers[index].nbytes:
            count -= buffers[index].nbytes
            index += 1
        buffers = [buffers[index][count:], *buffers[index + 1 :]]
        index = 0
        count = os.preadv(fd, buffers, offset)


def _scratch(size: int) -> memoryview:
    """``size`` bytes that gaps are read into (shared: nothing reads them)."""
    global _SCRATCH
    if _SCRATCH is None or len(_SCRATCH) < size:
        _SCRATCH = memoryview(bytearray(max(size, MAX_GAP)))
    return _SCRATCH[:size]


_SCRATCH: memoryview | None = None


def read_into(fd: int, offset: int, length: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` (exactly ``length`` bytes) from ``fd`` at ``offset``."""
    view = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
    assert view.nbytes == length, f"destination holds {view.nbytes} bytes, the region {length}"
    done = 0
    while done < length:
        count = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if count <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += count
