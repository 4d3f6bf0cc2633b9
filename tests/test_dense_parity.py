"""Parity of every dense layout with plain single-process transformers (fp32, tolerance 1e-5).

The quick subset (no activation checkpointing, untied) runs with ``-m "not slow"``; the full layout x
activation-checkpointing x tied-embeddings matrix is marked ``slow`` and runs in ``make test``.
"""

from __future__ import annotations

import pytest

from tests.cases.dense import dense_parity, replicated_layers_parity, sequence_parallel_is_active

TOLERANCE = 1e-5

LAYOUTS = {
    "fsdp2_dp4": (4, {"strategy": "fsdp2"}),
    "hsdp_2x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "tp2_sp": (2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
    "fsdp2_tp_2x2": (4, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_tp_sp_2x2": (4, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
    "hsdp_tp_2x1x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2, "tp_size": 2}),
    "ddp2": (2, {"strategy": "ddp"}),
}


def _matrix():
    for name, (world, layout) in LAYOUTS.items():
        for ac in (False, "full", "selective"):
            for tie in (False, True):
                quick = ac is False and not tie
                marks = [pytest.mark.distributed] + ([] if quick else [pytest.mark.slow])
                yield pytest.param(world, layout, ac, tie, id=f"{name}-ac_{ac}-tied_{tie}", marks=marks)


def _assert_parity(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["n_grads"] == result["n_ref_grads"], result
        assert result["logits"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["loss"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["grad"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["same_class"] and result["has_generate"] and result["has_save_pretrained"], result
        if "tied" in result:
            assert result["tied"], "tied embeddings became two parameters"


@pytest.mark.parametrize(("world", "layout", "activation_checkpointing", "tie"), _matrix())
def test_dense_layout_matches_plain_transformers(request, world, layout, activation_checkpointing, tie):
    pool = request.getfixturevalue(f"ranks{world}")
    _assert_parity(pool.run(dense_parity, layout, activation_checkpointing, tie))


@pytest.mark.distributed
def test_sequence_parallel_shards_the_decoder_activations(ranks2):
    results = ranks2.run(sequence_parallel_is_active, False)
    _assert_parity(results)
    for result in results:
        assert result["norm_seq"] == result["seq"] // 2, result
        assert result["norm_is_dtensor"], result


@pytest.mark.distributed
@pytest.mark.parametrize("activation_checkpointing", [False, "full", "selective"])
def test_layers_outside_the_tp_plan_run_replicated_under_sequence_parallelism(ranks2, activation_checkpointing):
    """Selective checkpointing replays a block's ops one by one: the swap of replicas to local tensors must run
    inside the checkpoint in forward as in the recomputation (it once ran outside in forward only: a backward error)."""
    _assert_parity(ranks2.run(replicated_layers_parity, activation_checkpointing))
