"""Read a contiguous region of a safetensors tensor straight into the destination shard with ``os.preadv``.

Why not only ``safe_open(...).get_slice``: its slices are views of a memory map, so copying them into a parameter
keeps both the mapped file pages and the copy resident during the load (about twice the shard size of host memory)
and costs a page fault per 4 KiB twice. When the region a rank needs is contiguous in the file and the dtypes match,
one positioned read into the parameter's own storage does the same work with one copy and no mapping. Anything else
(strided regions, dtype casts) goes through ``get_slice``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsHeader", "contiguous_byte_range", "read_header", "read_into"]

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


def contiguous_byte_range(entry: TensorEntry, slices: tuple[slice, ...]) -> tuple[int, int] | None:
    """The (offset, length) in bytes of ``tensor[slices]`` when that region is one contiguous run of the file."""
    if entry.dtype is None:
        return None
    shape = entry.shape
    bounds = [(s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(slices)]
    bounds += [(0, size) for size in shape[len(bounds) :]]
    # Contiguous iff every dim before the last partial one has extent 1 (the dims after it are whole by definition).
    partial = max((d for d, (lo, hi) in enumerate(bounds) if hi - lo != shape[d]), default=len(shape))
    if partial < len(shape) and any(hi - lo != 1 for lo, hi in bounds[:partial]):
        return None
    element = torch.tensor([], dtype=entry.dtype).element_size()
    strides = [element] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    offset = entry.start + sum(lo * strides[d] for d, (lo, _) in enumerate(bounds))
    if partial == len(shape):
        length = element * _prod(hi - lo for lo, hi in bounds)
    else:
        lo, hi = bounds[partial]
        length = (hi - lo) * strides[partial]
    return offset, length


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


def _prod(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result
