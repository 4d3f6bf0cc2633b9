"""Who writes which box of the parallel export (``region_writes.assign_writers``), decided by each rank alone from its
tensors' placements: every simulated rank of a world (torch's fake process group, tensors on meta) is asked in turn,
and every element of every tensor must be written by exactly one rank, with replicated tensors spread over their
holders. The all-reduce that settles copies outside a mesh and uncovered names is a no-op under the fake group; the
multi-rank byte-identity tests (test_parallel_export.py) run it for real.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from automodel._compat.torch import FakeStore, StridedShard
from automodel.loading.region_writes import assign_writers

SHAPES = {"embed": (10, 6), "norm": (6,), "up": (8, 6), "down": (6, 9), "odd": (3, 5)}

LAYOUTS = {
    "fsdp4": ((4,), {name: [Shard(0)] for name in SHAPES}),
    "hsdp2x2": ((2, 2), {name: [Replicate(), Shard(0)] for name in SHAPES}),
    "tp2_fsdp2": (
        (2, 2),
        {
            "embed": [Shard(0), Replicate()],
            "norm": [Shard(0), Replicate()],
            "up": [StridedShard(0, split_factor=2), Shard(0)],
            "down": [Shard(0), Shard(1)],
            "odd": [Replicate(), Replicate()],
        },
    ),
    "hsdp2_fsdp2_tp2": (
        (2, 2, 2),
        {name: [Replicate(), Shard(0), Shard(len(shape) - 1)] for name, shape in SHAPES.items()},
    ),  # fmt: skip
    "replicated8": ((8,), {name: [Replicate()] for name in SHAPES}),
}


def _writes_of_every_rank(mesh_shape, placements):
    world = math.prod(mesh_shape)
    names = sorted(SHAPES)
    writes = {name: torch.zeros(SHAPES[name], dtype=torch.int64) for name in names}
    writers = {name: set() for name in names}
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            local = {
                name: distribute_tensor(torch.empty(SHAPES[name], device="meta"), mesh, placements[name])
                for name in names
            }
            mine, uncovered = assign_writers(names, local)
            assert uncovered == set()
            for box, data in mine:
                assert tuple(data.shape) == box.sizes
                region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
                writes[box.name][region] += 1
                writers[box.name].add(rank)
        finally:
            dist.destroy_process_group()
    return writes, writers


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_element_is_written_by_exactly_one_rank(layout):
    mesh_shape, placements = LAYOUTS[layout]
    writes, _ = _writes_of_every_rank(mesh_shape, placements)
    for name, count in writes.items():
        assert torch.equal(count, torch.ones_like(count)), f"{layout}: {name} written {count.tolist()} times"


def test_replicated_tensors_spread_over_their_holders():
    _, writers = _writes_of_every_rank(*LAYOUTS["replicated8"])
    assert len(set().union(*writers.values())) == len(SHAPES)  # five tensors, five different writers


def test_a_plain_tensor_on_one_rank_is_written_whole_and_a_partial_one_is_uncovered():

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        partial = DTensor.from_local(torch.empty(4, device="meta"), mesh, [Partial()], run_check=False)
        mine, uncovered = assign_writers(["a", "b", "c"], {"a": torch.zeros(3, 2), "b": partial})
    finally:
        dist.destroy_process_group()
    assert [(box.name, box.offsets, box.sizes) for box, _ in mine] == [("a", (0, 0), (3, 2))]
    assert uncovered == {"b", "c"}
