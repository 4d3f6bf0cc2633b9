"""Tied embeddings under pipeline parallelism: the first stage holds the input embedding, the last a copy of it as
the head's weight (both loaded from the same checkpoint tensor); after each backward their gradients are summed
between the two stages (Megatron's embedding group), so both take the same optimizer step and stay equal."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .mesh import reused_groups
from .pipeline_layout import PipelineLayout

__all__ = ["check_tied_layouts", "embedding_group", "sum_tied_gradients", "tied_layouts", "tied_pairs"]

# name -> (placements, local shape) of the tied embedding and head copies a rank holds.
TiedLayouts = dict[str, tuple[str, tuple[int, ...]]]


def tied_pairs(
    parameters: dict[str, torch.Tensor], tied: list[tuple[str, str]], *, is_first: bool, is_last: bool
) -> list[list[torch.Tensor]]:
    """The local parameters of each tied (embedding, head) pair split between the first and the last stage: one of
    them on each of the two ranks, or both on a rank holding both stages (the V-shaped schedules)."""
    if not tied or not (is_first or is_last):
        return []
    held = [side for side, holds in ((0, is_first), (1, is_last)) if holds]
    return [[parameters[pair[side]] for side in held] for pair in tied]


def sum_tied_gradients(pairs: list[list[torch.Tensor]], group: Any) -> None:
    """Sum the gradients of the embedding (first stage) and its copy as the head (last stage): between the two
    stages' ranks over ``group`` (each stage-group coordinate's ranks holding them), or locally when one rank holds
    both.

    Each gradient is first laid out as its parameter (:func:`_laid_out_as_parameter`): under TP the two copies'
    gradients may come out of their backwards with different placements (a vocab-sharded embedding's lookup
    gradient is replicated, the colwise head's is sharded), and their local tensors would not be the same slice (nor
    of the same size) of the one tied weight."""
    for params in pairs:
        grads = [_laid_out_as_parameter(param) for param in params if param.grad is not None]
        if not grads:
            continue
        local = [_local(grad) for grad in grads]
        if len(params) == 2:
            total = sum(local[1:], local[0].clone())
            for grad in local:
                grad.copy_(total)
        else:
            dist.all_reduce(local[0], group=group)


def tied_layouts(parameters: dict[str, torch.Tensor], tied: list[tuple[str, str]]) -> TiedLayouts:
    """This rank's tied embedding and head copies: name -> (placements, local shape)."""
    return {
        name: (str(getattr(parameters[name], "placements", None)), tuple(_local(parameters[name]).shape))
        for pair in tied
        for name in pair
        if name in parameters
    }


def check_tied_layouts(layouts: list[TiedLayouts], tied: list[tuple[str, str]]) -> None:
    """Raise (on every rank of the pipeline: ``layouts`` is every pipeline rank's) when the first stage's embedding
    and the last stage's head, one tied weight, are sharded differently: their gradients could not be summed slice by
    slice. Without PP the TP step refuses such a plan for the one tied parameter; under PP each stage is
    parallelized alone."""
    seen = {name: layout for held in layouts for name, layout in held.items()}
    for embedding, head in tied:
        if embedding in seen and head in seen and seen[embedding] != seen[head]:
            raise ValueError(
                f"The tied parameters {embedding} (first pipeline stage) and {head} (last stage) are laid out "
                f"differently: {seen[embedding]} vs {seen[head]} (placements, local shape). Give them the same "
                "placement in the TP plan, or untie them (tie_word_embeddings=False)."
            )


def embedding_group(layout: PipelineLayout) -> Any:
    """The process groups of the first and the last stage's ranks, ``(pp=first, c)`` and ``(pp=last, c)``, for every
    stage-group coordinate ``c``; this rank's one (every rank must create every group, in the same order). ``None``
    when one pipeline rank holds both stages. Created once per layout and default group, like the meshes."""
    first, last = layout.stage_rank(0), layout.stage_rank(layout.num_stages - 1)
    if first == last:
        return None
    per_stage = dist.get_world_size() // layout.size

    def create() -> Any:
        mine = None
        for coordinate in range(per_stage):
            ranks = [first * per_stage + coordinate, last * per_stage + coordinate]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    return reused_groups(("embedding", per_stage, first, last), create)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _laid_out_as_parameter(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` with ``param``'s placements (set back as its ``.grad``): DTensor's embedding backward gives a
    vocab-sharded (``Shard(0)``) embedding a replicated gradient; redistributing it keeps this rank's rows (no
    collective for a replicated gradient, a reduce-scatter over the parameter's mesh for a partial one)."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return grad
