"""What a LoRA training checkpoint records of its base model, and the check on resume that it is the same base.

A checkpoint of a run with frozen parameters (LoRA: the whole base) holds only what training changes; the frozen
weights are read again from ``model.path`` when the run resumes. If they changed meanwhile (another checkpoint at the
same path, a file rewritten, another revision), the adapter would continue on a base it was not trained with: the
resume is refused, naming what differs.

The identity is ``model.path`` and its revision, and for each file that defines the weights (``config.json``, the
safetensors files and their index, ``.bin`` files) its size and modification time, with one SHA-256 over
``config.json``, the index and the safetensors headers (tensor names, shapes, dtypes and offsets: a few KB, never the
weights). At the same path every part must agree; a base moved to another path must have the same files (sizes and
digest; copying changes modification times), and the resume says where it is now.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

__all__ = ["BaseChanged", "base_identity", "check_base_identity", "weight_files_of"]

_WEIGHTS = (".safetensors", ".bin")


class BaseChanged(ValueError):
    """The base model at ``model.path`` is not the one the checkpoint's adapter was trained on."""


def weight_files_of(directory: Path) -> list[Path]:
    """The files of a checkpoint folder that define its weights: ``config.json``, weight files and their indexes."""
    files = [path for path in directory.iterdir() if path.is_file() and path.suffix in _WEIGHTS]
    files += [path for path in directory.glob("*.index.json") if path.is_file()]
    config = directory / "config.json"
    return sorted([*files, *([config] if config.is_file() else [])])


def base_identity(path: str, directory: Path, revision: str | None = None) -> dict[str, Any]:
    """The identity of the base model ``path`` (as ``model.path`` names it), whose files are in ``directory`` (the
    folder itself, or a hub id's snapshot in the cache)."""
    files = weight_files_of(directory)
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(_described_content(file))
    return {
        "path": str(path),
        "revision": revision,
        "files": {file.name: [file.stat().st_size, file.stat().st_mtime_ns] for file in files},
        "digest": digest.hexdigest(),
    }


def _described_content(file: Path) -> bytes:
    """What of ``file`` the digest covers: a JSON file whole, a safetensors file's header (its length, 8 bytes
    little-endian, and the JSON it announces), nothing of a ``.bin`` file (its size and time stand for it)."""
    if file.suffix == ".json":
        return file.read_bytes()
    if file.suffix != ".safetensors":
        return b""
    with file.open("rb") as handle:
        size = handle.read(8)
        return size + handle.read(struct.unpack("<Q", size)[0]) if len(size) == 8 else size


def check_base_identity(saved: dict[str, Any], now: dict[str, Any], checkpoint: Path) -> str | None:
    """Raise :class:`BaseChanged` when the base ``now`` is not the one ``saved`` in ``checkpoint``; a line to log when
    it is the same base at another path, else ``None``."""
    moved = saved["path"] != now["path"]
    where = f"model.path={now['path']}" + (f" (the checkpoint's base was {saved['path']})" if moved else "")
    fix = (
        f"Point model.path at the base {checkpoint} was trained on, or start over in another checkpoint.dir. The "
        "checkpoint holds only the adapter and its optimizer state: the base weights are read from model.path."
    )
    if saved.get("revision") != now.get("revision"):
        raise BaseChanged(f"{where}: revision {now.get('revision')!r}, but {checkpoint} was trained on revision "
                          f"{saved.get('revision')!r}. {fix}")  # fmt: skip
    if _sizes(saved) != _sizes(now) or saved["digest"] != now["digest"]:
        raise BaseChanged(f"{where} is not the base {checkpoint} was trained on: {_differences(saved, now)}. {fix}")
    if moved:
        return f"the base model moved: {checkpoint} was trained on {saved['path']}; the same files are at {now['path']}"
    rewritten = sorted(name for name, stat in now["files"].items() if saved["files"][name][1] != stat[1])
    if rewritten:
        raise BaseChanged(
            f"{where}: {', '.join(rewritten)} changed (written again) since {checkpoint} was trained on it. {fix}"
        )
    return None


def _sizes(identity: dict[str, Any]) -> dict[str, int]:
    return {name: stat[0] for name, stat in identity["files"].items()}


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    before, after = saved["files"], now["files"]
    parts = [f"{name} is gone" for name in sorted(set(before) - set(after))]
    parts += [f"{name} is new" for name in sorted(set(after) - set(before))]
    parts += [
        f"{name} has {after[name][0]} bytes, not {before[name][0]}"
        for name in sorted(set(before) & set(after))
        if before[name][0] != after[name][0]
    ]
    return "; ".join(parts[:4]) or "its config or its tensors' names, shapes or dtypes differ"
