"""Read a box of a safetensors tensor (one ``[start, stop)`` range per dim) straight into the destination shard with
positioned reads (``os.preadv``).

Why not ``safe_open(...).get_slice``: its slices are views of a memory map, so copying them into a parameter keeps
both the mapped file pages and the copy resident during the load (about twice the shard size of host memory) and costs
a page fault per 4 KiB twice. For a box that is not contiguous in the file it is worse: a dim-1 shard (a rowwise TP
weight) touches the pages of its whole row band, TP times its own bytes (3.75x the local shards in host memory for a
70B model under FSDP2 x TP=8). Here the box is read as the contiguous byte runs it is made of, each straight into its
place in the parameter's storage when the dtypes match, or through a bounded staging buffer that is cast while it is
copied when they do not: host memory grows by the local shard plus at most ``STAGING_BYTES``.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

__all__ = [
    "SAFETENSORS_DTYPES",
    "STAGING_BYTES",
    "SafetensorsHeader",
    "byte_runs",
    "read_header",
    "read_into",
    "read_runs",
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
    element = torch.tensor([], dtype=entry.dtype).element_size()
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


#: The most a read holds besides its destination: short runs are read in spans of at most this many bytes, and a cast
#: read stages its bytes here before casting them into place.
STAGING_BYTES = 16 << 20
#: Short runs close together (a dim-1 shard's rows) are read as one span when the span is at most this many times the
#: bytes wanted: thousands of small reads cost more than reading past the gaps (44 us per 2 KiB read against 0.5 us
#: per KiB copied from the page cache: the rowwise weights of a 70B model under TP=8 read row by row took 7 s).
SPAN_AMPLIFICATION = 16


def read_runs(fd: int, offsets: torch.Tensor, length: int, dtype: torch.dtype, out: torch.Tensor) -> int:
    """Fill the contiguous CPU tensor ``out`` with the byte runs at ``offsets`` (ascending, each ``length`` bytes of
    ``dtype``, in order), cast while copied when ``out``'s dtype differs. Long runs of the same dtype are read
    straight into ``out``; short runs close together are read as spans through a buffer of at most
    ``STAGING_BYTES`` and copied out of it, the next span being read (by a reader thread: ``preadv`` and the copy
    both release the GIL) while the last one is copied. Host memory beyond ``out``: two such buffers. Returns the
    bytes read from the file (the gaps inside spans included)."""
    if length == 0 or len(offsets) == 0:
        return 0
    element = torch.tensor([], dtype=dtype).element_size()
    target = out.detach().view(-1)
    position = 0  # elements of `out` filled so far
    staged: list[tuple[int, int, Callable[[torch.Tensor], None]]] = []  # (file offset, bytes, copy out of the buffer)
    read = 0
    for group in _spans(offsets.tolist(), length):
        count = len(group) * length // element
        destination = target[position : position + count]
        position += count
        read += group[-1] + length - group[0]
        if len(group) == 1 and out.dtype == dtype:
            read_into(fd, group[0], length, destination)
        elif len(group) == 1:  # one long run, cast: in pieces of the buffer
            piece = max(element, STAGING_BYTES // element * element)
            for start in range(0, length, piece):
                size = min(piece, length - start)
                part = destination[start // element : (start + size) // element]
                staged.append((group[0] + start, size, partial(_cast_into, part, dtype)))
        else:
            starts = [offset - group[0] for offset in group]
            staged.append(
                (group[0], group[-1] + length - group[0], partial(_runs_into, destination, starts, length, dtype))
            )
    _read_staged(fd, staged)
    return read


def _read_staged(fd: int, staged: list[tuple[int, int, Callable[[torch.Tensor], None]]]) -> None:
    """Read each (offset, size) into a staging buffer and hand it to its copy, two buffers in flight."""
    if not staged:
        return
    buffers = _staging_buffers()

    def fetch(index: int):
        offset, size, _ = staged[index]
        return _reader().submit(read_into, fd, offset, size, buffers[index % 2][:size])

    pending = fetch(0)
    for index, (_, size, copy_out) in enumerate(staged):
        pending.result()
        following = fetch(index + 1) if index + 1 < len(staged) else None
        copy_out(buffers[index % 2][:size])
        pending = following


def _staging_buffers() -> list[torch.Tensor]:
    """The two staging buffers, allocated once per process: fresh ones per tensor cost a page fault per 4 KiB of
    them every time (about 8,000 per read), more than the copies they serve."""
    global _BUFFERS
    if _BUFFERS is None or _BUFFERS[0].numel() != STAGING_BYTES:
        _BUFFERS = [torch.empty(STAGING_BYTES, dtype=torch.uint8) for _ in range(2)]
    return _BUFFERS


_BUFFERS: list[torch.Tensor] | None = None


def _reader() -> ThreadPoolExecutor:
    global _READER
    if _READER is None:
        _READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="automodel-read")
    return _READER


_READER: ThreadPoolExecutor | None = None


def _cast_into(destination: torch.Tensor, dtype: torch.dtype, buffer: torch.Tensor) -> None:
    destination.copy_(buffer.view(dtype))


def _runs_into(
    destination: torch.Tensor, starts: list[int], length: int, dtype: torch.dtype, span: torch.Tensor
) -> None:
    runs = _runs_of(span, starts, length)
    if destination.dtype == dtype:
        destination.view(torch.uint8).view(len(starts), length).copy_(runs)
    else:
        destination.copy_(runs.contiguous().view(-1).view(dtype))


def spanned_bytes(offsets: torch.Tensor, length: int) -> int:
    """The bytes :func:`read_runs` reads from the file for these runs (the gaps inside coalesced spans included)."""
    if length == 0:
        return 0
    return sum(group[-1] + length - group[0] for group in _spans(offsets.tolist(), length))


def _spans(offsets: list[int], length: int) -> list[list[int]]:
    """``offsets`` grouped into spans read at once: consecutive short runs whose span fits ``STAGING_BYTES`` and is
    at most ``SPAN_AMPLIFICATION`` times their bytes; a run of ``STAGING_BYTES`` or more is a group of its own."""
    groups: list[list[int]] = []
    for offset in offsets:
        group = groups[-1] if groups else None
        if group is not None and length < STAGING_BYTES:
            span = offset + length - group[0]
            if span <= STAGING_BYTES and span <= SPAN_AMPLIFICATION * length * (len(group) + 1):
                group.append(offset)
                continue
        groups.append([offset])
    return groups


def _runs_of(span: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """The runs at byte ``starts`` of ``span``, as a (runs, length) uint8 tensor: a strided view when the runs are
    evenly spaced (rows of a box), a gathered copy otherwise."""
    if len(starts) == 1:
        return span[starts[0] : starts[0] + length].view(1, length)
    stride = starts[1] - starts[0]
    if all(b - a == stride for a, b in itertools.pairwise(starts)):
        return span[starts[0] :].as_strided((len(starts), length), (stride, 1))
    return torch.stack([span[start : start + length] for start in starts])


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
