"""Each rank's part of a sharded tensor as a box of the whole tensor, who writes which box, and writing a box into a
file at its offsets.

A rank's local shard of a ``DTensor`` (``Shard`` / ``Replicate`` placements, FSDP2's strided shards of a TP-sharded
dimension included) is one box of the global tensor, the chunk ``torch.distributed.checkpoint`` saves it as. In the
row-major bytes of the whole tensor a box is a set of runs: one for a dim-0 shard, one per row of a dim-1 (rowwise
TP) shard, and so on. ``write_box`` writes those runs with ``os.pwrite`` straight from the shard's memory, so no rank
ever assembles a whole tensor.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel._compat.torch import StridedShard
from automodel.distributed.runtime import collective_device, full_tensor, rank, world_size

from .placements import index_runs_at, local_index_runs

__all__ = ["Box", "assign_writers", "gathered_to", "local_box", "write_box"]


@dataclass(frozen=True)
class Box:
    """The part of stored tensor ``name`` at ``offsets`` (per dimension) of size ``sizes``."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def local_box(name: str, tensor: torch.Tensor) -> tuple[Box, torch.Tensor] | None:
    """This rank's part of ``tensor`` (stored as ``name``) and its local data: the whole of a plain tensor, the local
    shard of a ``DTensor``; ``None`` for a ``DTensor`` whose local data is not one box of the value (``Partial``
    placements: pending sums; a shard whose rows interleave with other ranks').

    The box is computed in closed form from the placements (:func:`~.placements.local_index_runs`), not with torch's
    ``__create_chunk_list__``, whose ``_StridedShard`` case splits an index tensor into every rank's chunk (2.5 s per
    rank for a 70B model at 1,024 ranks).
    """
    if not isinstance(tensor, DTensor):
        return Box(name, (0,) * tensor.dim(), tuple(tensor.shape)), tensor
    if any(placement.is_partial() for placement in tensor.placements):
        return None
    local = tensor.to_local()
    bounds = [_one_run(runs) for runs in local_index_runs(tensor)]
    if any(bound is None for bound in bounds):
        return None
    offsets = tuple(start for start, _ in bounds)
    sizes = tuple(stop - start for start, stop in bounds)
    if sizes != tuple(local.shape):
        return None
    return Box(name, offsets, sizes), local


def _one_run(runs: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Ascending index runs in local order as one ``(start, stop)``, or ``None`` when they leave gaps."""
    if not runs:
        return 0, 0
    for (_, stop), (start, _) in itertools.pairwise(runs):
        if stop != start:
            return None
    return runs[0][0], runs[-1][1]


def assign_writers(
    names: Sequence[str], local: Mapping[str, torch.Tensor]
) -> tuple[list[tuple[Box, torch.Tensor]], set[str]]:
    """Collective: the boxes this rank writes, with their data, out of the tensors ``names`` (the same list, in the same
    order, on every rank) that it holds in ``local``; and the names no set of boxes covers (to be written another way).

    Decided from each tensor's own placements, with one all-reduce of one integer per name, so that the cost per rank
    does not grow with the world size:

    - A ``DTensor`` (``Shard`` / ``Replicate`` placements) covers its tensor over its mesh. The ranks that differ only
      in their coordinates on the ``Replicate`` mesh dimensions hold the same box (HSDP replicas, a TP-replicated
      norm); one of them writes it, the box's number (name index + shard coordinates) modulo their count choosing
      which, so replicated tensors spread over the ranks.
    - A plain tensor is a box of the whole tensor on each rank holding it.
    - Where several meshes (or plain copies) hold the same name (a model replicated outside its mesh), the copy with
      the smallest key writes it: a mesh's smallest rank, or a plain holder's rank rotated by the name's index (again
      spreading the writers).
    - A name no rank holds, or that some rank holds otherwise than as one box (``Partial`` placements: pending sums;
      rows interleaved with other ranks'), is uncovered: all of it is written another way, never partly as boxes.
    """
    own_rank, world = rank(), world_size()
    keys = torch.full((len(names),), _NO_COPY, dtype=torch.int64)
    parts: dict[int, tuple[Box, torch.Tensor]] = {}
    meshes: dict[int, _MeshFacts] = {}  # by id: torch recomputes a mesh's ranks and shape on every access
    for number, name in enumerate(names):
        tensor = local.get(name)
        if tensor is None:
            continue
        part = local_box(name, tensor)
        if part is None:
            keys[number] = _NOT_A_BOX  # held, but not as one box: nobody writes this name as boxes
            continue
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if id(mesh) not in meshes:
                meshes[id(mesh)] = _MeshFacts(int(mesh.mesh.min()), tuple(mesh.shape), mesh.get_coordinate())
            facts = meshes[id(mesh)]
            keys[number] = 2 * facts.first_rank
            if part[1].numel() > 0 and _writes_replica(tensor.placements, facts, number):
                parts[number] = part
        else:
            keys[number] = 2 * ((own_rank - number) % world) + 1
            if part[1].numel() > 0:
                parts[number] = part
    mine_keys = keys.clone()
    if world > 1:
        agreed = keys.to(collective_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        keys = agreed.cpu()
    uncovered = {name for number, name in enumerate(names) if keys[number] in (_NO_COPY, _NOT_A_BOX)}
    mine = [part for number, part in parts.items() if mine_keys[number] == keys[number]]
    return mine, uncovered


_NO_COPY = 2**62  # no rank holds the name
_NOT_A_BOX = -1  # some rank holds it, but not as one box (``Partial``, interleaved rows): the smallest key wins


@dataclass(frozen=True)
class _MeshFacts:
    first_rank: int
    shape: tuple[int, ...]
    coordinate: list[int] | None  # this rank's, None off the mesh


def _writes_replica(placements: Sequence, mesh: _MeshFacts, number: int) -> bool:
    """Whether this rank is the one, among the ranks of a ``DTensor``'s mesh holding the same box, that writes it."""
    if mesh.coordinate is None:
        return False
    replicated = [dim for dim, placement in enumerate(placements) if placement.is_replicate()]
    sharded = [dim for dim in range(len(mesh.shape)) if dim not in replicated]
    replica = _linear(mesh.coordinate, replicated, mesh.shape)
    shard = _linear(mesh.coordinate, sharded, mesh.shape)
    replicas = math.prod(mesh.shape[dim] for dim in replicated)
    return replica == (number + shard) % replicas


def _linear(coordinate: Sequence[int], dims: Sequence[int], shape: Sequence[int]) -> int:
    """``coordinate`` restricted to ``dims``, as one row-major index."""
    index = 0
    for dim in dims:
        index = index * shape[dim] + coordinate[dim]
    return index


def gathered_to(tensor: torch.Tensor, owner: int) -> torch.Tensor | None:
    """Collective: the whole value of ``tensor`` on rank ``owner`` (on the local shard's device), ``None`` elsewhere.

    A ``DTensor`` whose mesh spans the world and whose shards are plain boxes (``Shard`` / ``Replicate``) is sent box by
    box to the owner alone, each box by one holder (the first replica), so no other rank holds more than its shards;
    the owner holds the whole tensor and one box in flight. Any other ``DTensor`` goes through ``full_tensor`` (every
    rank of its mesh gathers it); a plain tensor is its own value on every rank that holds it.
    """
    own_rank, world = rank(), world_size()
    if not isinstance(tensor, DTensor):
        return tensor if own_rank == owner else None
    tensor = tensor.detach()
    mesh = tensor.device_mesh
    if mesh.size() != world or any(
        placement.is_partial() or isinstance(placement, StridedShard) for placement in tensor.placements
    ):
        full = full_tensor(tensor)
        return full if own_rank == owner else None
    replicated = [dim for dim, placement in enumerate(tensor.placements) if placement.is_replicate()]
    local = tensor.to_local()
    coordinate = mesh.get_coordinate()
    if own_rank != owner:
        if all(coordinate[dim] == 0 for dim in replicated) and local.numel() > 0:
            dist.send(local.contiguous(), dst=owner)
        return None
    full = torch.empty(tensor.shape, dtype=local.dtype, device=local.device)
    ranks = mesh.mesh
    first_replicas = [range(1) if dim in replicated else range(size) for dim, size in enumerate(mesh.shape)]
    for holder in itertools.product(*first_replicas):
        bounds = [_one_run(runs) for runs in index_runs_at(tensor, holder)]  # one run each: no strided shards
        region = tuple(slice(start, stop) for start, stop in bounds)
        if any(start == stop for start, stop in bounds):
            continue
        source = int(ranks[holder])
        if source == own_rank:
            full[region] = local
            continue
        box = torch.empty([stop - start for start, stop in bounds], dtype=local.dtype, device=local.device)
        dist.recv(box, src=source)
        full[region] = box
        del box
    return full


def write_box(fd: int, start: int, shape: Sequence[int], offsets: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data``, the part at ``offsets`` of a row-major tensor of ``shape`` whose bytes begin at ``start`` in
    the file ``fd``, run by run (one ``pwrite`` per contiguous run of the whole tensor's bytes)."""
    data = data.detach()
    if data.numel() == 0:
        return
    if data.device.type != "cpu":
        data = data.cpu()  # the one write buffer: this shard's bytes
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    sizes = tuple(data.shape)
    whole = len(shape)  # the trailing dimensions the box spans whole
    while whole > 0 and sizes[whole - 1] == shape[whole - 1]:
        whole -= 1
    itemsize = data.element_size()
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    run = math.prod(sizes[max(whole - 1, 0) :]) * itemsize  # the partial dimension and the whole ones after it
    outer = [range(size) for size in sizes[: max(whole - 1, 0)]]
    for number, index in enumerate(itertools.product(*outer)):
        first = sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        if whole > 0:
            first += offsets[whole - 1] * strides[whole - 1]
        _pwrite_all(fd, raw[number * run : (number + 1) * run], start + first * itemsize)


def _pwrite_all(fd: int, buffer: Iterable, position: int) -> None:
    """``os.pwrite`` until every byte is written (one call writes at most about 2 GiB on Linux)."""
    view = memoryview(buffer).cast("B")
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written
