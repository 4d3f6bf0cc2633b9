"""The stored tensors of a checkpoint directory: which file holds each key, its shape, and slice reads.

Safetensors checkpoints (one file or an index with shards) are read through ``safe_open(...).get_slice``: the file
is memory-mapped and a slice read copies only the requested bytes. ``.bin``-only checkpoints are read with
``torch.load(weights_only=True, mmap=True)``, which also maps the file instead of reading it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["CheckpointError", "CheckpointFiles", "open_checkpoint"]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, corrupt or inconsistent."""


class CheckpointFiles:
    """Key -> file map of a checkpoint plus lazily opened, memory-mapped readers."""

    def __init__(self, directory: Path, key_to_file: dict[str, str], kind: str) -> None:
        self.directory = directory
        self.key_to_file = key_to_file
        self.kind = kind
        self.bytes_read = 0
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def keys(self) -> Iterable[str]:
        """Every stored key."""
        return self.key_to_file.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key`` (read from the file header, not the data)."""
        if key not in self._shapes:
            handle = self._handle(self.key_to_file[key])
            if self.kind == "safetensors":
                self._shapes[key] = tuple(handle.get_slice(key).get_shape())
            else:
                self._shapes[key] = tuple(handle[key].shape)
        return self._shapes[key]

    def read_slice(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``stored[key][slices]`` as a new tensor holding only those elements."""
        handle = self._handle(self.key_to_file[key])
        try:
            if self.kind == "safetensors":
                tensor = handle.get_slice(key)[slices] if slices else handle.get_tensor(key)
            else:
                tensor = handle[key][slices].clone()
        except (SafetensorError, RuntimeError, OSError) as error:
            raise CheckpointError(f"Reading {key!r} from {self.key_to_file[key]} failed: {error}") from error
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _handle(self, filename: str):
        if filename not in self._handles:
            path = self.directory / filename
            try:
                if self.kind == "safetensors":
                    self._handles[filename] = safe_open(str(path), framework="pt", device="cpu")
                else:
                    self._handles[filename] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except FileNotFoundError as error:
                raise CheckpointError(f"Checkpoint file {path} is missing.") from error
            except Exception as error:  # safetensors / pickle report truncation and corruption with many types
                raise CheckpointError(
                    f"Checkpoint file {path} cannot be read ({type(error).__name__}: {error}); it may be truncated "
                    "or corrupt: download it again."
                ) from error
        return self._handles[filename]

    def validate(self) -> None:
        """Open every file once so a missing, truncated or corrupt shard fails before any weight is copied."""
        for filename in sorted(set(self.key_to_file.values())):
            handle = self._handle(filename)
            if self.kind == "safetensors":
                _check_safetensors_size(self.directory / filename, handle)


def _check_safetensors_size(path: Path, handle) -> None:
    """safetensors maps the file lazily: compare the header's data size with the file size to catch truncation."""
    with open(path, "rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_size))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    expected = 8 + header_size + end
    actual = os.path.getsize(path)
    if actual < expected:
        raise CheckpointError(
            f"Checkpoint file {path} is truncated: {actual} bytes, its header describes {expected}. Download it again."
        )


def open_checkpoint(directory: Path) -> CheckpointFiles:
    """Find the weights in ``directory`` (safetensors preferred, then ``.bin``) and map every key to its file."""
    directory = Path(directory)
    for index_name, single_name, kind in ((SAFE_INDEX, SAFE_SINGLE, "safetensors"), (BIN_INDEX, BIN_SINGLE, "bin")):
        if (directory / index_name).is_file():
            weight_map = _read_index(directory / index_name)
            missing = sorted({name for name in weight_map.values() if not (directory / name).is_file()})
            if missing:
                raise CheckpointError(
                    f"{directory / index_name} names files that are not in {directory}: {missing}. The download is "
                    "incomplete: fetch the checkpoint again."
                )
            return CheckpointFiles(directory, weight_map, kind)
        if (directory / single_name).is_file():
            files = CheckpointFiles(directory, {}, kind)
            files.key_to_file = dict.fromkeys(_single_file_keys(directory / single_name, files, kind), single_name)
            return files
    raise CheckpointError(
        f"No weights in {directory}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}."
    )


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a valid checkpoint index (no 'weight_map'): {error}") from error
    return dict(weight_map)


def _single_file_keys(path: Path, files: CheckpointFiles, kind: str) -> list[str]:
    handle = files._handle(path.name)
    return list(handle.keys())
