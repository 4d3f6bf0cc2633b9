"""The stored tensors of a checkpoint directory: which file holds each key, its shape, and slice reads.

Safetensors checkpoints (one file or an index with shards) are read through ``safe_open(...).get_slice``: the file
is memory-mapped and a slice read copies only the requested bytes. ``.bin``-only checkpoints are read with
``torch.load(weights_only=True, mmap=True)``, which also maps the file instead of reading it (files in the pre-zip
pickle format of torch < 1.6 cannot be mapped and are loaded whole, as transformers does).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .direct_read import SAFETENSORS_DTYPES, SafetensorsHeader, byte_runs, read_header, spanned_bytes
from .reader import read_runs

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "MissingCheckpointFileError",
    "open_checkpoint",
    "open_safetensors_file",
    "read_json",
    "stored_dtype",
    "weight_files",
]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
# The weight files a directory may hold, in the order they are looked for: (file name, kind, whether it is an
# index). transformers names them model.* / pytorch_model.* and takes the single file before the index (its
# _get_resolved_checkpoint_files); diffusers names a component's diffusion_pytorch_model.* and takes the index first
# (ModelMixin.from_pretrained).
WEIGHT_FILES = [
    (SAFE_SINGLE, "safetensors", False),
    (SAFE_INDEX, "safetensors", True),
    ("diffusion_pytorch_model.safetensors.index.json", "safetensors", True),
    ("diffusion_pytorch_model.safetensors", "safetensors", False),
    (BIN_SINGLE, "bin", False),
    (BIN_INDEX, "bin", True),
    ("diffusion_pytorch_model.bin.index.json", "bin", True),
    ("diffusion_pytorch_model.bin", "bin", False),
]
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors refuses larger headers: such a length is garbage, not truncation


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, corrupt or inconsistent."""


class MissingCheckpointFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there (a shard its index names, or any weights at all): both a
    ``CheckpointError`` and a ``FileNotFoundError``."""


def read_json(path: Path) -> Any:
    """The JSON document in ``path``; a damaged file is a ``CheckpointError`` naming it (``json`` alone names only
    a line and column)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}): the file is "
            "damaged or incomplete. Download it again."
        ) from error


class CheckpointFiles:
    """Key -> file map of a checkpoint plus lazily opened, memory-mapped readers."""

    def __init__(self, directory: Path, key_to_file: dict[str, str], kind: str) -> None:
        self.directory = directory
        self.key_to_file = key_to_file
        self.kind = kind
        self.bytes_read = 0  # the bytes of the requested regions (what this rank's shards need)
        self.bytes_spanned = 0  # the bytes read from the files: the regions plus the gaps inside coalesced spans
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._headers: dict[str, SafetensorsHeader] = {}
        self._descriptors: dict[str, int] = {}

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

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype of ``key`` (from the file header); ``None`` for a dtype torch has no name for."""
        handle = self._handle(self.key_to_file[key])
        if self.kind != "safetensors":
            return handle[key].dtype
        header = self._headers.get(self.key_to_file[key])
        if header is not None and key in header.entries:
            return header.entries[key].dtype
        return SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())

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
        self.bytes_spanned += tensor.numel() * tensor.element_size()
        return tensor

    def read_into(self, key: str, slices: tuple[slice, ...], out: torch.Tensor, *, defer: bool = False) -> bool:
        """Fill the contiguous ``out`` (host memory or an accelerator's) with ``stored[key][slices]`` by positioned
        reads of the byte runs that box is made of, cast while copied where the dtypes differ (see ``direct_read``).
        With ``defer``, inside ``reader.parallel_reads``, the reads are queued to its reader threads and done when
        that block exits. Returns False, having done nothing, where it cannot (a ``.bin`` checkpoint, a dtype this
        torch lacks)."""
        if self.kind != "safetensors" or not out.is_contiguous() or out.device.type == "meta":
            return False
        filename = self.key_to_file[key]
        entry = self._entry(key)
        runs = None if entry is None else byte_runs(entry, slices)
        if runs is None:
            return False
        offsets, length = runs
        if filename not in self._descriptors:
            self._descriptors[filename] = os.open(self.directory / filename, os.O_RDONLY)
        what = f"{key!r} from {self.directory / filename}"
        try:
            self.bytes_spanned += read_runs(
                self._descriptors[filename], offsets, length, entry.dtype, out, what=what, defer=defer
            )
        except OSError as error:
            raise CheckpointError(f"Reading {what} failed: {error}") from error
        self.bytes_read += len(offsets) * length
        return True

    def count(self, key: str, slices: tuple[slice, ...]) -> None:
        """Add to ``bytes_read`` / ``bytes_spanned`` what reading ``stored[key][slices]`` would take, reading no data
        (the headers only): the read plan of :meth:`read_into`."""
        entry = self._entry(key) if self.kind == "safetensors" else None
        runs = None if entry is None else byte_runs(entry, slices)
        if runs is None:
            shape = self.shape(key)
            bounds = [(s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(slices)]
            count = 1
            for dim, size in enumerate(shape):
                count *= bounds[dim][1] - bounds[dim][0] if dim < len(bounds) else size
            dtype = self.dtype(key) or torch.uint8
            self.bytes_read += count * torch.tensor([], dtype=dtype).element_size()
            self.bytes_spanned += count * torch.tensor([], dtype=dtype).element_size()
            return
        offsets, length = runs
        self.bytes_read += len(offsets) * length
        self.bytes_spanned += spanned_bytes(offsets, length)

    def _entry(self, key: str):
        """``key``'s entry in its file's parsed header (offsets, shape, dtype)."""
        filename = self.key_to_file[key]
        if filename not in self._headers:
            self._headers[filename] = read_header(self.directory / filename)
        return self._headers[filename].entries.get(key)

    def close(self) -> None:
        """Release the open files and memory maps."""
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()
        self._handles.clear()

    def _handle(self, filename: str):
        if filename not in self._handles:
            path = self.directory / filename
            try:
                if self.kind == "safetensors":
                    header = _checked_header(path)
                    if header is not None:
                        self._headers[filename] = header
                    self._handles[filename] = safe_open(str(path), framework="pt", device="cpu")
                else:
                    # Files from before torch 1.6 (not zip archives) cannot be memory-mapped: load them whole.
                    mmap = zipfile.is_zipfile(path)
                    self._handles[filename] = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except CheckpointError:
                raise
            except FileNotFoundError as error:
                raise CheckpointError(f"Checkpoint file {path} is missing.") from error
            except Exception as error:  # safetensors / pickle report truncation and corruption with many types
                raise CheckpointError(
                    f"Checkpoint file {path} cannot be read ({type(error).__name__}: {error}); it may be truncated "
                    "or corrupt: download it again."
                ) from error
        return self._handles[filename]

    def validate(self) -> None:
        """Open every file once so a missing, truncated or corrupt shard, or an index naming a tensor its shard does
        not hold, fails before any weight is copied."""
        expected: dict[str, set[str]] = {}
        for key, filename in self.key_to_file.items():
            expected.setdefault(filename, set()).add(key)
        for filename in sorted(expected):
            absent = sorted(expected[filename] - set(self._handle(filename).keys()))
            if absent:
                raise CheckpointError(
                    f"The checkpoint index in {self.directory} places {_listing(absent)} in {filename}, which does not "
                    "hold it: the index and the shards come from different downloads. Fetch the checkpoint again."
                )


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


def _checked_header(path: Path) -> SafetensorsHeader | None:
    """The file's parsed header; raises when the file is shorter than its header says (a truncated download).

    Runs before ``safe_open``, whose own report of a short file does not say so plainly. A header that cannot be
    parsed gives ``None``, left for ``safe_open`` to report as corruption.
    """
    actual = os.path.getsize(path)
    if actual < 8:
        raise CheckpointError(
            f"Checkpoint file {path} is truncated: {actual} bytes, shorter than a safetensors header. Download it again."
        )
    with open(path, "rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
    if header_size > MAX_SAFETENSORS_HEADER:
        return None
    if 8 + header_size > actual:
        raise CheckpointError(
            f"Checkpoint file {path} is truncated: {actual} bytes, its header alone takes {8 + header_size}. "
            "Download it again."
        )
    try:
        header = read_header(path)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if actual < header.expected_size:
        raise CheckpointError(
            f"Checkpoint file {path} is truncated: {actual} bytes, its header describes {header.expected_size}. "
            "Download it again."
        )
    return header


def weight_files(
    use_safetensors: bool | None = None, variant: str | None = None, *, diffusers: bool = True
) -> list[tuple[str, str, bool]]:
    """The ``(file name, kind, is an index)`` to look for, in the order transformers (and diffusers) looks for them.

    ``use_safetensors``: ``None`` prefers safetensors and falls back to ``.bin``, ``True`` takes safetensors only,
    ``False`` ``.bin`` only. ``variant`` (e.g. ``"fp16"``) selects ``model.fp16.safetensors`` /
    ``model.safetensors.index.fp16.json`` and their ``.bin`` counterparts, as transformers names them. ``diffusers``:
    also diffusers' component names (``diffusion_pytorch_model.*``, with a variant also its legacy index name
    ``diffusion_pytorch_model.safetensors.fp16.index.json``).
    """
    kinds = {None: ("safetensors", "bin"), True: ("safetensors",), False: ("bin",)}[use_safetensors]
    found = []
    for name, kind, is_index in WEIGHT_FILES:
        if kind not in kinds or (not diffusers and name.startswith(DIFFUSERS_WEIGHTS)):
            continue
        found.append((with_variant(name, variant), kind, is_index))
        if variant and is_index and name.startswith(DIFFUSERS_WEIGHTS):
            # diffusers still reads its legacy variant index name (``....safetensors.fp16.index.json``).
            found.append((f"{DIFFUSERS_WEIGHTS}.{kind}.{variant}.index.json", kind, True))
    return found


def with_variant(name: str, variant: str | None) -> str:
    """transformers' (and diffusers') ``_add_variant``: ``model.safetensors`` -> ``model.fp16.safetensors``,
    ``model.safetensors.index.json`` -> ``model.safetensors.index.fp16.json``, and a shard pattern
    ``model{suffix}.safetensors`` -> ``model.fp16{suffix}.safetensors``."""
    if not variant:
        return name
    stem, _, extension = name.rpartition(".")
    if stem.endswith("{suffix}"):
        return f"{stem.removesuffix('{suffix}')}.{variant}{{suffix}}.{extension}"
    return f"{stem}.{variant}.{extension}"


def open_checkpoint(
    directory: Path, *, use_safetensors: bool | None = None, variant: str | None = None
) -> CheckpointFiles:
    """Find the weights in ``directory`` (see :func:`weight_files`; transformers' or diffusers' file names) and map
    every key to its file."""
    directory = Path(directory)
    candidates = weight_files(use_safetensors, variant)
    for name, kind, is_index in candidates:
        if not (directory / name).is_file():
            continue
        if is_index:
            weight_map = _read_index(directory / name)
            missing = sorted({shard for shard in weight_map.values() if not (directory / shard).is_file()})
            if missing:
                raise MissingCheckpointFileError(
                    f"{directory / name} names files that are not in {directory}: {missing}. The download is "
                    "incomplete: fetch the checkpoint again."
                )
            return CheckpointFiles(directory, weight_map, kind)
        files = CheckpointFiles(directory, {}, kind)
        files.key_to_file = dict.fromkeys(_single_file_keys(directory / name, files, kind), name)
        return files
    expected = ", ".join(name for name, _, _ in candidates)
    chosen = "".join(
        f" ({option}={value!r})"
        for option, value in (("use_safetensors", use_safetensors), ("variant", variant))
        if value is not None
    )
    raise MissingCheckpointFileError(f"No weights in {directory}{chosen}: expected one of {expected}.")


def stored_dtype(
    directory: Path, *, use_safetensors: bool | None = None, variant: str | None = None
) -> torch.dtype | None:
    """The dtype transformers' ``dtype="auto"`` takes when the config records none: that of the first tensor of the
    checkpoint's first file (by name) that is stored in a float dtype a model is built in (fp32, fp16, bf16, fp64; not
    the float8 codes of a quantized checkpoint), in the order the file lists its tensors; ``None`` without one."""
    files = open_checkpoint(directory, use_safetensors=use_safetensors, variant=variant)
    try:
        first = min(files.key_to_file.values(), default=None)
        keys = [] if first is None else files._handle(first).keys()
        for key in keys:
            dtype = files.dtype(key)
            if dtype in MODEL_DTYPES:
                return dtype
        return None
    finally:
        files.close()


def open_safetensors_file(path: Path) -> CheckpointFiles:
    """One safetensors file (e.g. a peft adapter's ``adapter_model.safetensors``) as checkpoint files: every key of
    it, read slice by slice; a truncated or corrupt file fails here."""
    path = Path(path)
    if not path.is_file():
        raise MissingCheckpointFileError(f"{path} does not exist.")
    files = CheckpointFiles(path.parent, {}, "safetensors")
    files.key_to_file = dict.fromkeys(_single_file_keys(path, files, "safetensors"), path.name)
    return files


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = read_json(path)["weight_map"]
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a valid checkpoint index (no 'weight_map'): {error}") from error
    return dict(weight_map)


def _single_file_keys(path: Path, files: CheckpointFiles, kind: str) -> list[str]:
    handle = files._handle(path.name)
    return list(handle.keys())
