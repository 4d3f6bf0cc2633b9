"""The bytes of a safetensors file decided from names, shapes and dtypes alone: the header ``save_file`` writes and
where each tensor's data goes, so that several processes can write their parts of one file at their offsets
(``os.pwrite``) and nobody holds the whole file.

safetensors has no API for a header without the data, so the order of the tensors in the file and the names of their
dtypes are taken from safetensors itself (``save`` of empty stand-ins: its order is by dtype, then by name, whatever
the sizes), and the offsets follow from the sizes. The tests check the result byte for byte against ``save_file``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import save

__all__ = ["FileLayout", "file_layout"]

_LENGTH = struct.Struct("<Q")  # the header's length, before it
_ALIGNMENT = 8  # safetensors pads the header with spaces to a multiple of 8 bytes


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its header bytes (length included), each tensor's first byte, and the file's size."""

    header: bytes
    offsets: dict[str, int]
    size: int


def file_layout(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FileLayout:
    """The layout ``save_file(tensors, path, metadata)`` writes; only the shapes and dtypes of ``tensors`` are read
    (meta tensors serve)."""
    stand_ins = {name: torch.empty(0, dtype=tensor.dtype) for name, tensor in tensors.items()}
    probe = save(stand_ins, metadata=metadata)
    (length,) = _LENGTH.unpack_from(probe)
    entries = json.loads(probe[_LENGTH.size : _LENGTH.size + length])  # in the file's order
    header: dict[str, object] = {}
    if "__metadata__" in entries:
        header["__metadata__"] = entries.pop("__metadata__")
    spans, begin = {}, 0
    for name, entry in entries.items():
        shape = list(tensors[name].shape)
        end = begin + math.prod(shape) * tensors[name].dtype.itemsize
        header[name] = {"dtype": entry["dtype"], "shape": shape, "data_offsets": [begin, end]}
        spans[name], begin = spans.get(name, begin), end
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % _ALIGNMENT)
    start = _LENGTH.size + len(encoded)
    return FileLayout(
        _LENGTH.pack(len(encoded)) + encoded, {name: start + offset for name, offset in spans.items()}, start + begin
    )
