"""Which elements of a global tensor one rank holds, for every placement the parallelizer can produce."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from automodel._compat.torch import StridedShard
from automodel.distributed.megatron_fsdp import is_megatron_fsdp_parameter, megatron_fsdp_local_indices

__all__ = [
    "IndexRuns",
    "checked_local_runs",
    "index_runs_at",
    "local_index_runs",
    "local_indices",
    "local_runs",
    "rank_classes",
    "to_runs",
]

# For each tensor dim, the sorted-by-local-position list of contiguous global ranges (start, stop) a rank holds.
IndexRuns = list[list[tuple[int, int]]]


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """For each dim, the global indices of this rank's local elements, in local order.

    A plain tensor holds everything. For a ``DTensor`` the placements are applied in mesh-dim order with DTensor's
    own split rules (``Shard``: ``torch.chunk`` semantics, uneven and empty shards included; ``StridedShard``: the
    interleaved layout FSDP2 produces over a TP-sharded dim; ``Replicate``/``Partial``: all). Only this rank's chunk
    of each split is computed, in closed form: the cost does not grow with the mesh size (splitting index vectors
    into every rank's chunk took 2.5 s per rank for a 70B model at 4,096 ranks).
    """
    if is_megatron_fsdp_parameter(tensor):
        return megatron_fsdp_local_indices(tensor)
    return [_from_runs(dim_runs) for dim_runs in checked_local_runs(tensor)]


def checked_local_runs(tensor: torch.Tensor) -> IndexRuns:
    """:func:`local_index_runs`, checked against the shape of the local shard (not for a Megatron-FSDP parameter,
    whose shard only :func:`local_indices` knows). The loader reads by these runs, without expanding them into index
    vectors: building and splitting those again cost 0.1 ms per tensor. Adjacent runs are merged, as :func:`to_runs`
    splits an index vector (a ``_StridedShard`` over a mesh dim of size 1 gives its pieces back to back)."""
    runs = [_merged(dim_runs) for dim_runs in local_index_runs(tensor)]
    if isinstance(tensor, DTensor):
        local_shape = tuple(tensor.to_local().shape)
        if tuple(sum(stop - start for start, stop in dim_runs) for dim_runs in runs) != local_shape:
            raise RuntimeError(
                f"A local shard of shape {local_shape} does not match its placements {tensor.placements} over a "
                f"{tuple(tensor.shape)} tensor: a layout the loader cannot place (a sharding other than DTensor's "
                "split rules)."
            )
    return runs


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``runs`` with each run that starts where the one before it stops joined to it."""
    merged: list[tuple[int, int]] = []
    for start, stop in runs:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


def local_index_runs(tensor: torch.Tensor) -> IndexRuns:
    """For each dim, this rank's global indices of ``tensor`` (a plain tensor or a ``DTensor``) as ascending runs in
    local order: :func:`local_indices` before it expands them, computed in closed form."""
    if not isinstance(tensor, DTensor):
        return [[(0, size)] for size in tensor.shape]
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the tensor's device mesh")
    return index_runs_at(tensor, coordinate)


def index_runs_at(tensor: DTensor, coordinate: Sequence[int]) -> IndexRuns:
    """:func:`local_index_runs` of the rank at ``coordinate`` of ``tensor``'s mesh."""
    runs: IndexRuns = [[(0, size)] for size in tensor.shape]
    mesh = tensor.device_mesh
    for mesh_dim, placement in enumerate(tensor.placements):
        # `StridedShard.is_shard()` is False in torch 2.13, so test the types.
        if not isinstance(placement, (Shard, StridedShard)):
            continue
        dim = placement.dim if placement.dim >= 0 else placement.dim + tensor.ndim
        runs[dim] = local_runs(runs[dim], placement, mesh.size(mesh_dim), coordinate[mesh_dim])
    return runs


def local_runs(runs: list[tuple[int, int]], placement: Placement, num_chunks: int, index: int) -> list[tuple[int, int]]:
    """Chunk ``index`` of ``num_chunks`` that ``placement`` (``Shard`` or ``StridedShard``) cuts the index sequence
    ``runs`` (ascending runs ``(start, stop)``, in local order) into, as runs: DTensor's split rule for one rank."""
    length = sum(stop - start for start, stop in runs)
    if not isinstance(placement, StridedShard):
        return _take(runs, *_chunk_bounds(length, num_chunks, index))
    # First split into `split_factor` pieces (the shards of the dims sharded before, as if right to left), then each
    # piece into `num_chunks`; this rank's chunks of every piece, in piece order.
    chunks: list[tuple[int, int]] = []
    for piece in range(placement.split_factor):
        piece_start, piece_stop = _chunk_bounds(length, placement.split_factor, piece)
        start, stop = _chunk_bounds(piece_stop - piece_start, num_chunks, index)
        chunks += _take(runs, piece_start + start, piece_start + stop)
    return chunks


def _chunk_bounds(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of chunk ``index`` when ``torch.chunk`` cuts ``length`` items into ``num_chunks``
    (chunks of ``ceil(length / num_chunks)``; the last ones short or empty)."""
    size = -(-length // num_chunks)
    return min(index * size, length), min((index + 1) * size, length)


def _take(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of the sequence ``runs`` describes, as runs."""
    taken, position = [], 0
    for run_start, run_stop in runs:
        lo, hi = max(start - position, 0), min(stop - position, run_stop - run_start)
        if lo < hi:
            taken.append((run_start + lo, run_start + hi))
        position += run_stop - run_start
        if position >= stop:
            break
    return taken


def _from_runs(runs: list[tuple[int, int]]) -> torch.Tensor:
    if len(runs) == 1:
        return torch.arange(*runs[0])
    return torch.cat([torch.arange(start, stop) for start, stop in runs]) if runs else torch.arange(0)


def to_runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Split an index vector into maximal contiguous ascending runs ``[(start, stop), ...]`` (in order)."""
    if indices.numel() == 0:
        return []
    # With tensor ops: a shard's index vector is thousands long, and a Python loop over it costs more than its read.
    steps = indices.diff()
    if bool((steps == 1).all()):  # one run, the common case (a Shard's chunk, an unsharded dim)
        return [(int(indices[0]), int(indices[-1]) + 1)]
    breaks = torch.nonzero(steps != 1).flatten() + 1
    firsts = torch.cat([breaks.new_zeros(1), breaks])
    lasts = torch.cat([breaks - 1, breaks.new_full((1,), indices.numel() - 1)])
    return list(zip(indices[firsts].tolist(), (indices[lasts] + 1).tolist(), strict=True))


def rank_classes(model: torch.nn.Module, world_size: int) -> list[list[int]]:
    """The ranks of a ``world_size``-rank job grouped by the local shapes of ``model``'s parameters (parallelized, as
    any one rank sees it): ranks in one group hold shards of the same shapes. Groups are ordered by their first
    rank, each ascending.

    A shard's size along a tensor dim depends only on the rank's coordinates on the mesh dims that split that dim,
    so each such size is tabulated once over those coordinates (in closed form, :func:`local_runs`) and looked up
    for every rank: the cost is the mesh sizes times the distinct layouts, not the ranks times the parameters.
    """
    columns: list[torch.Tensor] = []
    seen: set[tuple] = set()
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        key = (id(mesh), tuple(map(str, param.placements)), tuple(param.shape))
        if key in seen:
            continue
        seen.add(key)
        coordinates = _coordinates_of_every_rank(mesh, world_size)
        for dim, size in enumerate(param.shape):
            splits = [
                (mesh_dim, placement)
                for mesh_dim, placement in enumerate(param.placements)
                if isinstance(placement, (Shard, StridedShard))
                and (placement.dim if placement.dim >= 0 else placement.dim + param.ndim) == dim
            ]
            if splits:
                columns.append(_local_sizes(size, splits, mesh, coordinates))
    if not columns:
        return [list(range(world_size))]
    _, inverse = torch.unique(torch.stack(columns, dim=1), dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for rank, group in enumerate(inverse.tolist()):
        groups.setdefault(group, []).append(rank)
    return sorted(groups.values(), key=lambda members: members[0])


def _coordinates_of_every_rank(mesh, world_size: int) -> torch.Tensor:
    """A (world_size, mesh.ndim) tensor: each rank's coordinate on every dim of ``mesh`` (-1 off the mesh)."""
    ranks = mesh.mesh.flatten()
    positions = torch.full((world_size,), -1, dtype=torch.int64)
    positions[ranks] = torch.arange(ranks.numel())
    coordinates = torch.full((world_size, mesh.ndim), -1, dtype=torch.int64)
    present = positions >= 0
    remaining = positions[present]
    for dim in range(mesh.ndim - 1, -1, -1):
        coordinates[present, dim] = remaining % mesh.size(dim)
        remaining = remaining // mesh.size(dim)
    return coordinates


def _local_sizes(size: int, splits: list[tuple[int, Placement]], mesh, coordinates: torch.Tensor) -> torch.Tensor:
    """Every rank's shard length along one tensor dim of ``size``, split by ``splits`` (mesh dim, placement) in
    mesh-dim order."""
    mesh_dims = [mesh_dim for mesh_dim, _ in splits]
    extents = [mesh.size(mesh_dim) for mesh_dim in mesh_dims]
    table = torch.zeros(extents, dtype=torch.int64)
    for combination in itertools.product(*(range(extent) for extent in extents)):
        runs = [(0, size)]
        for (mesh_dim, placement), index in zip(splits, combination, strict=True):
            runs = local_runs(runs, placement, mesh.size(mesh_dim), index)
        table[combination] = sum(stop - start for start, stop in runs)
    chosen = coordinates[:, mesh_dims]
    sizes = table[tuple(chosen.clamp(min=0).T)]
    return torch.where((chosen >= 0).all(dim=1), sizes, -1)
