"""Parity of every dense layout with plain single-process transformers (fp32, tolerance 1e-5).

The quick subset (no activation checkpointing, untied) runs with ``-m "not slow"``; the full layout x
activation-checkpointing x tied-embeddings matrix is marked ``slow`` and runs in ``make test``.
"""

from __future__ import annotations

import pytest

from tests.cases.dense import dense_parity, replicated_layers_parity, reshard_policy_states, sequence_parallel_is_active
from tests.tiny_models import tiny_llama_config

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


@pytest.mark.distributed
@pytest.mark.parametrize("policy", [None, True, False], ids=["all_but_last", "always", "never"])
def test_reshard_policy_holds_what_it_states_and_nothing_after_a_forward_without_backward(ranks2, policy):
    """Between a training forward and its backward the policy's units stay unsharded (always: the ones Llama's
    transformers FSDP plan marks ``keep_full_weight``, the final norm and the head; the default, torchtitan's: also the
    last layer; never: every unit); after a forward no backward can follow (under
    no_grad, or with every parameter frozen) none does, so ``named_parameters()`` returns shards; parity holds."""
    last = f"model.layers.{tiny_llama_config().num_hidden_layers - 1}"
    layers = [f"model.layers.{index}" for index in range(tiny_llama_config().num_hidden_layers)]
    kept = {
        None: [last, "lm_head", "model.norm"],
        True: ["lm_head", "model.norm"],
        False: [*layers, "model.embed_tokens", "lm_head", "model.norm"],
    }[policy]
    for result in ranks2.run(reshard_policy_states, policy):
        assert result["after_no_grad"] == [] and result["after_frozen"] == [], result
        assert result["before_backward"] == sorted(kept), result
        assert result["after_backward"] == [], result
    _assert_parity(ranks2.run(reshard_policy_states, policy))
