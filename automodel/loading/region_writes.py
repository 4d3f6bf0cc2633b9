"""Each rank's part of a sharded tensor as a box of the whole tensor, who writes which box, and writing a box into a
file at its offsets.

A rank's local shard of a ``DTensor`` (``Shard`` / ``Replicate`` placements, FSDP2's strided shards of a TP-sharded
dimension included) is one box of the global tensor: its offsets and sizes are what ``torch.distributed.checkpoint``
saves it under (``DTensor.__create_chunk_list__``). In the row-major bytes of the whole tensor a box is a set of runs:
one for a dim-0 shard, one per row of a dim-1 (rowwise TP) shard, and so on. ``write_box`` writes those runs with
``os.pwrite`` straight from the shard's memory, so no rank ever assembles a whole tensor.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["Box", "assign_writers", "local_box", "write_box"]


@dataclass(frozen=True)
class Box:
    """The part of stored tensor ``name`` at ``offsets`` (per dimension) of size ``sizes``."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def local_box(name: str, tensor: torch.Tensor) -> tuple[Box, torch.Tensor] | None:
    """This rank's part of ``tensor`` (stored as ``name``) and its local data: the whole of a plain tensor, the local
    shard of a ``DTensor``; ``None`` for a ``DTensor`` whose local data is not a part of the value (``Partial``
    placements: pending sums)."""
    if not isinstance(tensor, DTensor):
        return Box(name, (0,) * tensor.dim(), tuple(tensor.shape)), tensor
    if any(placement.is_partial() for placement in tensor.placements):
        return None
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        return None
    return Box(name, tuple(chunks[0].offsets), tuple(chunks[0].sizes)), local


def assign_writers(boxes: Sequence[Box], shapes: dict[str, tuple[int, ...]]) -> tuple[list[Box], set[str]]:
    """Collective: the boxes this rank writes, out of the non-empty ``boxes`` it holds, and the stored tensors no
    set of boxes covers exactly (to be written another way).

    Every rank learns every rank's boxes (names and offsets only). A box several ranks hold (a replicated tensor, an
    HSDP replica, a TP-replicated norm) is written by one of them: the ``k``-th box of the same holders by the
    ``k mod holders``-th of them, so replicated tensors spread over the ranks. A tensor is covered when its distinct boxes add up to its
    size (shards do not overlap); anything else is reported, not written as boxes.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[list[Box]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, list(boxes))
        rank = dist.get_rank()
    else:
        everyone, rank = [list(boxes)], 0
    holders: dict[Box, list[int]] = {}
    for holder, held in enumerate(everyone):
        for box in held:
            holders.setdefault(box, []).append(holder)
    covered: dict[str, int] = dict.fromkeys(shapes, 0)
    for box in holders:
        covered[box.name] = covered.get(box.name, 0) + math.prod(box.sizes)
    uncovered = {name for name, shape in shapes.items() if covered[name] != math.prod(shape)}
    mine, turns = [], {}
    for box in sorted(holders, key=lambda box: (box.name, box.offsets)):
        ranks = tuple(holders[box])
        if box.name in uncovered:
            continue
        turn = turns.get(ranks, 0)  # each set of holders takes its boxes in turn
        turns[ranks] = turn + 1
        if ranks[turn % len(ranks)] == rank:
            mine.append(box)
    return mine, uncovered


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
