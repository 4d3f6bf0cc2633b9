"""Writing a consolidated safetensors checkpoint from every rank at once: no rank gathers the model, and the files are
byte for byte what ``save_file`` of the whole state would write.

1. Rank 0 creates every file at its full size with its header, from names, shapes and dtypes alone
   (:mod:`.safetensors_layout`), in a staging directory every rank sees.
2. Each stored tensor that equals one model tensor (renamed at most) is written by the ranks holding it, each its own
   box (:mod:`.region_writes`) at its offsets; a box several ranks hold is written by one of them, spread over the
   holders.
3. What cannot be written as boxes (a conversion that builds stored tensors from a model tensor: fused MoE experts
   split per expert; a tensor whose shards do not cover it) is gathered whole, one model tensor at a time, to one
   owner: the ``k``-th such tensor to rank ``k mod world``, so that these too spread over the ranks (all on rank 0
   where the gathering itself delivers to rank 0, as a pipelined model's does).

Where the ranks do not share the staging directory (nodes without a shared file system), every tensor is gathered to
rank 0 and written there. Every failure is raised on every rank after the last collective.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from automodel.distributed import runtime

from .agreement import agree_or_raise
from .region_writes import Box, assign_writers, gathered_to, write_box
from .safetensors_layout import FileLayout, file_layout

__all__ = ["WeightFiles", "gathered_to", "make_staging_dir", "write_weight_files"]

_METADATA = {"format": "pt"}


@dataclass
class WeightFiles:
    """What to write: the files and where each stored tensor comes from.

    ``gather(source)`` is collective (every rank, the sources in the same order) and gives the full source tensor on
    the rank it is for (``None`` elsewhere); ``convert(source, full)`` turns it into its stored tensors.
    """

    files: dict[str, list[str]]  # file name -> stored names
    stored: dict[str, torch.Tensor]  # stored name -> a tensor of its shape and dtype (meta)
    source_of: dict[str, str]  # stored name -> model tensor name
    direct: set[str]  # the stored names equal to their source (renamed at most): written as boxes
    local: dict[str, torch.Tensor]  # model tensor name -> this rank's (sharded) tensor, where it holds one
    gather: Callable[[str, int], torch.Tensor | None]  # (source, owner) -> the full tensor on ``owner``
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
    gathers_to_rank_zero: bool = False  # ``gather`` delivers on rank 0 whatever the owner asked for

    def local_by_stored(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the stored names written as boxes."""
        return {name: self.local[self.source_of[name]] for name in self.direct if self.source_of[name] in self.local}


def make_staging_dir(target: Path, suffix: str) -> Path | None:
    """Collective: a fresh temporary directory beside ``target``, created by rank 0; its path on every rank (``None``
    on the others when rank 0 failed, which raises on every rank)."""
    path, error = None, None
    if runtime.rank() == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent))
            # mkdtemp makes it private (0700); the export it becomes gets the mode any new folder gets (umask).
            path.chmod(0o777 & ~_umask())
        except Exception as exc:
            error = exc
    agree_or_raise(error, f"Creating a temporary directory beside {target}")
    if runtime.world_size() > 1:
        shared = [path]
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]
    return path


def _umask() -> int:
    """The process's file mode creation mask (read by setting it, then set back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_weight_files(staging: Path, spec: WeightFiles, what: str) -> None:
    """Collective: write ``spec``'s files into ``staging`` (from :func:`make_staging_dir`)."""
    layouts = {name: file_layout({k: spec.stored[k] for k in names}, _METADATA) for name, names in spec.files.items()}
    error = None
    if runtime.rank() == 0:
        try:
            for name, layout in layouts.items():
                _create(staging / name, layout)
        except Exception as exc:
            error = exc
    agree_or_raise(error, f"Creating the files of {what}")
    shared = _everywhere(all(_has_size(staging / name, layout.size) for name, layout in layouts.items()))
    where = {stored: (name, layout.offsets[stored]) for name, layout in layouts.items() for stored in spec.files[name]}
    shapes = {name: tuple(tensor.shape) for name, tensor in spec.stored.items()}

    mine: list[tuple[Box, torch.Tensor]] = []
    uncovered, error = set(spec.direct), None
    if shared:
        try:
            mine, uncovered = assign_writers(sorted(spec.direct), spec.local_by_stored())
        except Exception as exc:
            error = exc
    agree_or_raise(error, f"Reading the local shards for {what}")
    whole = [name for names in spec.files.values() for name in names if name not in spec.direct or name in uncovered]
    sources = list(dict.fromkeys(spec.source_of[name] for name in whole))
    needed = set(whole)

    files = _OpenFiles(staging)
    error = None
    try:
        for box, data in mine:
            file, start = where[box.name]
            write_box(files[file], start, shapes[box.name], box.offsets, data)
    except Exception as exc:
        error = exc
    rank, world = runtime.rank(), runtime.world_size()
    for number, source in enumerate(sources):
        owner = 0 if spec.gathers_to_rank_zero or not shared else number % world
        full = spec.gather(source, owner)
        if rank == owner and full is not None and error is None:
            try:
                for stored, value in spec.convert(source, full).items():
                    if stored in needed:
                        file, start = where[stored]
                        write_box(files[file], start, shapes[stored], (0,) * len(shapes[stored]), value)
            except Exception as exc:
                error = exc
        del full
    try:
        files.close()
    except Exception as exc:
        error = error or exc
    agree_or_raise(error, f"Writing {what}")
    if world > 1:
        dist.barrier()


def _create(path: Path, layout: FileLayout) -> None:
    with open(path, "wb") as file:
        file.write(layout.header)
        file.truncate(layout.size)  # sparse until the ranks write the data


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


class _OpenFiles(dict):
    """The staging files this rank writes into, each opened once, on first use."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def __missing__(self, name: str) -> int:
        fd = os.open(self.directory / name, os.O_WRONLY)
        self[name] = fd
        return fd

    def close(self) -> None:
        for fd in self.values():
            os.close(fd)
        self.clear()


def _everywhere(flag: bool) -> bool:
    """Collective: whether ``flag`` holds on every rank."""
    if runtime.world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=runtime.collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
