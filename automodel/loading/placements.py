"""Which elements of a global tensor one rank holds, for every placement the parallelizer can produce."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from automodel._compat.torch import StridedShard, split_placement
from automodel.distributed.megatron_fsdp import is_megatron_fsdp_parameter, megatron_fsdp_local_indices

__all__ = ["IndexRuns", "local_indices", "to_runs"]

# For each tensor dim, the sorted-by-local-position list of contiguous global ranges (start, stop) a rank holds.
IndexRuns = list[list[tuple[int, int]]]


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """For each dim, the global indices of this rank's local elements, in local order.

    A plain tensor holds everything. For a ``DTensor`` the placements are applied to index vectors in mesh-dim order
    with the placements' own split rules (``Shard``: ``torch.chunk`` semantics, uneven shards included;
    ``StridedShard``: the interleaved layout FSDP2 produces over a TP-sharded dim; ``Replicate``/``Partial``: all).
    """
    if is_megatron_fsdp_parameter(tensor):
        return megatron_fsdp_local_indices(tensor)
    indices = [torch.arange(size) for size in tensor.shape]
    if not isinstance(tensor, DTensor):
        return indices
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the tensor's device mesh")
    for mesh_dim, placement in enumerate(tensor.placements):
        # `StridedShard.is_shard()` is False in torch 2.13, so test the types.
        if not isinstance(placement, (Shard, StridedShard)):
            continue
        dim = placement.dim if placement.dim >= 0 else placement.dim + tensor.ndim
        indices[dim] = split_placement(_on_dim0(placement), indices[dim], mesh.size(mesh_dim))[coordinate[mesh_dim]]
    local_shape = tuple(tensor.to_local().shape)
    if tuple(len(dim_indices) for dim_indices in indices) != local_shape:
        raise RuntimeError(
            f"A local shard of shape {local_shape} does not match its placements {tensor.placements} over a "
            f"{tuple(tensor.shape)} tensor: a layout the loader cannot place (a sharding other than DTensor's split "
            "rules)."
        )
    return indices


def _on_dim0(placement: Placement) -> Placement:
    """The same split rule applied to a 1-D index vector."""
    if isinstance(placement, StridedShard):
        return StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


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
