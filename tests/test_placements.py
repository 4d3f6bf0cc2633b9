"""The loader's closed-form per-rank chunk of a placement against DTensor's own split rule (``Shard._split_tensor``
on an index vector), for even, uneven and empty shards, ``StridedShard`` split factors and two placements on one dim.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from automodel._compat.torch import FakeStore, StridedShard, split_placement
from automodel.loading.placements import checked_local_runs, local_indices, local_runs, to_runs

PLACEMENTS = [Shard(0), *(StridedShard(0, split_factor=factor) for factor in (1, 2, 3, 4))]


def _indices(runs: list[tuple[int, int]]) -> list[int]:
    return [index for start, stop in runs for index in range(start, stop)]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_one_rank_chunk_is_dtensors_split(placement):
    for length, num_chunks in itertools.product([*range(0, 25), 31, 40, 64], range(1, 10)):
        vector = torch.arange(length)
        expected = split_placement(placement, vector, num_chunks) if length else [vector] * num_chunks
        for index in range(num_chunks):
            chunk = expected[index].tolist() if index < len(expected) else []
            assert _indices(local_runs([(0, length)], placement, num_chunks, index)) == chunk, (length, num_chunks)


@pytest.mark.parametrize(("outer", "inner"), itertools.product(PLACEMENTS, PLACEMENTS), ids=str)
def test_a_second_placement_splits_the_first_ones_chunk(outer, inner):
    """Mesh dims applied in order, as ``local_indices`` does: the second split cuts the first one's chunk (whose
    runs need not be one)."""
    for length, first, second in itertools.product((0, 7, 16, 30), (1, 2, 3), (1, 2, 4)):
        vector = torch.arange(length)
        for i in range(first):
            pieces = split_placement(outer, vector, first) if length else []
            piece = pieces[i] if i < len(pieces) else torch.arange(0)
            runs = local_runs([(0, length)], outer, first, i)
            assert _indices(runs) == piece.tolist()
            for j in range(second):
                parts = split_placement(inner, piece, second) if len(piece) else []
                part = parts[j].tolist() if j < len(parts) else []
                assert _indices(local_runs(runs, inner, second, j)) == part


def test_runs_cost_does_not_grow_with_the_number_of_chunks():
    """One rank's chunk of 8,192 comes from a constant number of runs (no list of every rank's chunk)."""
    assert local_runs([(0, 8192)], Shard(0), 8192, 8191) == [(8191, 8192)]
    assert local_runs([(0, 1024)], Shard(0), 8192, 5000) == []
    assert to_runs(torch.arange(5, 9)) == [(5, 9)]


def test_fsdp_shards_dim_0_unless_padding_it_would_waste_more_than_a_sixteenth():
    from automodel.distributed.fsdp import fsdp_shard_dim

    assert fsdp_shard_dim((4096, 1024), 64) == 0  # even
    assert fsdp_shard_dim((97, 64), 4) == 0  # 3 padding rows of 97: under 1/16
    assert fsdp_shard_dim((2, 3072, 4096), 16) == 1  # two local experts over 16 ranks: a slice of each expert
    assert fsdp_shard_dim((1024, 8192), 8192) == 1  # a KV projection at 8,192 ranks
    assert fsdp_shard_dim((3, 5), 4) == 0  # no later dim divides: dim 0, padded
    assert fsdp_shard_dim((7,), 8) == 0 and fsdp_shard_dim((), 8) == 0 and fsdp_shard_dim((2, 8), 1) == 0


def test_checked_runs_are_the_runs_of_the_local_indices():
    """What the loader reads by (``checked_local_runs``, closed form, adjacent runs merged) is what it read by before:
    the maximal runs of ``local_indices``' index vectors. Every rank of simulated 2 x 3, 3 x 2 and 1 x 3 meshes, over
    a tensor whose dims carry one placement or two (FSDP2's ``_StridedShard`` over TP's ``Shard``), with uneven and
    empty shards and a mesh dim of size 1."""
    for shape in ((2, 3), (3, 2), (1, 3)):
        for rank in range(shape[0] * shape[1]):
            dist.init_process_group("fake", rank=rank, world_size=shape[0] * shape[1], store=FakeStore())
            try:
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
                first = [Shard(0), Shard(1), StridedShard(0, split_factor=shape[1]), Replicate()]
                for placements in itertools.product(first, [Shard(0), Shard(1)]):
                    for size in ((12, 5), (5, 7), (1, 9)):
                        tensor = DTensor.from_local(
                            torch.empty(_local_shape(size, mesh, placements), device="meta"),
                            mesh,
                            placements,
                            run_check=False,
                            shape=size,
                            stride=(size[1], 1),
                        )
                        expected = [to_runs(dim_indices) for dim_indices in local_indices(tensor)]
                        assert checked_local_runs(tensor) == expected, (rank, shape, placements, size)
            finally:
                dist.destroy_process_group()


def _local_shape(size, mesh, placements) -> tuple[int, ...]:
    """The local shard shape DTensor's split rules give this rank (the loader's closed form is the oracle's own
    subject in the tests above; here only the shape is needed to build the tensor)."""
    runs = [[(0, extent)] for extent in size]
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, StridedShard)):
            runs[placement.dim] = local_runs(runs[placement.dim], placement, mesh.size(mesh_dim), coordinate[mesh_dim])
    return tuple(sum(stop - start for start, stop in dim_runs) for dim_runs in runs)
