"""Expert parallelism (the unified MoE path) on CPU ranks: logits, loss and every gradient within 1e-4 of one plain
process, for Mixtral, Qwen3-MoE and OLMoE (transformers' fused-experts layout)."""

from __future__ import annotations

import pytest

from tests.cases.context_parallel import cp_parity
from tests.cases.expert_parallel import ep_error, ep_parity, moe_fsdp_primitive, parity_or_refusal, router_loss_step

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
MOE_ARCHITECTURES = ["mixtral", "qwen3_moe", "olmoe"]
LAYOUTS = {
    # ep_shard = world / ep: how many ranks FSDP-shard each expert group.
    "ep2_ep_shard2": (4, {"strategy": "fsdp2", "ep_size": 2}),
    "ep4": (4, {"strategy": "fsdp2", "ep_size": 4}),
    "ep2_x_tp2": (4, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}),
}


def _assert_parity(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
@pytest.mark.parametrize(("world", "layout"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_expert_parallel_matches_one_process(request, world, layout, architecture):
    results = request.getfixturevalue(f"ranks{world}").run(ep_parity, layout, architecture)
    _assert_parity(results)
    # 4 experts: whole experts per EP rank (4 / ep), then FSDP over ep_shard (world / ep): one local expert each.
    ep, ep_shard = layout["ep_size"], world // layout["ep_size"]
    assert results[0]["expert_local_experts"] == 4 // ep // ep_shard == 1


@pytest.mark.parametrize("layout", [{"ep_size": 4}, {"ep_size": 2, "tp_size": 2}], ids=["ep4", "ep2_x_tp2"])
def test_experts_that_get_no_tokens_still_match(ranks4, layout):
    """One token id everywhere: two of the four experts of each layer receive nothing (with EP=4 their owners get
    empty exchanges) and their gradients are exactly zero, as in the reference."""
    results = ranks4.run(ep_parity, {"strategy": "fsdp2", **layout}, "mixtral", True)
    assert all(0 in layer for layer in results[0]["routes_per_expert"]), results[0]["routes_per_expert"]
    _assert_parity(results)


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, {"ep_size": 2}),
        (4, {"ep_size": 2, "dp_replicate_size": 2}),
        (4, {"ep_size": 2, "tp_size": 2, "sequence_parallel": True}),
        (4, {"ep_size": 2, "activation_checkpointing": "full"}),
        (4, {"ep_size": 4, "activation_checkpointing": "selective"}),
    ],
    ids=["ep2_on_2_ranks", "ep2_x_hsdp", "ep2_x_tp2_sp", "ep2_full_ac", "ep4_selective_ac"],
)
def test_expert_parallel_composes(request, world, layout):
    _assert_parity(request.getfixturevalue(f"ranks{world}").run(ep_parity, {"strategy": "fsdp2", **layout}, "mixtral"))


@pytest.mark.parametrize("architecture", ["mixtral", "qwen3_moe"])
def test_expert_parallel_with_context_parallel(ranks4, architecture):
    layout = {"strategy": "fsdp2", "ep_size": 2, "cp_size": 2}
    for result in ranks4.run(cp_parity, layout, architecture, 16):
        assert result["local_len"] == 8
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


@pytest.mark.parametrize("customizes", [True, False])
def test_customizes_moe_fsdp_decides_whether_the_sidecar_primitive_runs(ranks4, customizes):
    for result in ranks4.run(moe_fsdp_primitive, customizes):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result
        if customizes:
            # Experts first (after EP made them local), then the decoder layers, the embeddings / head, the root.
            assert result["sharded"][:2] == ["MixtralExperts"] * 2, result["sharded"]
            assert result["sharded"].count("MixtralDecoderLayer") == 2 and result["sharded"][-1] == "MixtralForCausalLM"
        else:
            assert result["sharded"] == [], result["sharded"]
        assert result["fsdp_units"].count("MixtralExperts") == 2


@pytest.mark.parametrize(
    ("world", "layout", "architecture", "overrides", "expected"),
    [
        (4, {"ep_size": 4}, "mixtral", {"num_local_experts": 6}, "model.layers.0.mlp.experts has 6 experts"),
        (2, {"ep_size": 2}, "llama", {}, "LlamaForCausalLM has no routed experts"),
        (4, {"ep_size": 2, "tp_size": 4}, "mixtral", {}, "ep_size=2 must be a multiple of tp_size=4"),
    ],
    ids=["experts_not_divisible", "dense_model", "ep_not_multiple_of_tp"],
)
def test_bad_expert_layouts_are_clear_errors(request, world, layout, architecture, overrides, expected):
    for message in request.getfixturevalue(f"ranks{world}").run(
        ep_error, {"strategy": "fsdp2", **layout}, architecture, **overrides
    ):
        assert expected in message, message


# Sequence parallelism has one answer per model on both paths: the routed-experts block runs on the whole sequence
# whether TP shards its experts (dense path) or EP owns them; OLMoE's attention gathers its colwise output (per-layer
# q/k norms over the whole width), which SP cannot follow on either path.
SP_ANSWERS = {"mixtral": None, "qwen3_moe": None, "olmoe": "TP style 'colwise_gather_output' of model.layers.0"}


@pytest.mark.parametrize("architecture", SP_ANSWERS)
def test_sequence_parallel_has_one_answer_with_and_without_ep(ranks4, architecture):
    answers = []
    for layout in ({"tp_size": 2}, {"ep_size": 2, "tp_size": 2}):
        results = ranks4.run(
            parity_or_refusal, {"strategy": "fsdp2", "sequence_parallel": True, **layout}, architecture
        )
        refusal = results[0]["refused"]
        assert all(result["refused"] == refusal for result in results), results
        if refusal is None:
            _assert_parity(results)
            # The SP gather and the EP combine hand back owned tensors, not ``to_local`` views.
            assert results[0]["view_outputs"] == [], results[0]["view_outputs"]
        answers.append(refusal)
    assert answers[0] == answers[1], answers
    expected = SP_ANSWERS[architecture]
    assert (answers[0] is None) if expected is None else (expected in answers[0]), answers[0]


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("layout", [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "ep_size": 2}], ids=["fsdp2", "ep2"])
def test_the_router_loss_counts_once_per_step_whatever_the_micro_batches(ranks2, layout, micro_batches):
    """The router loss is a mean over a forward's tokens: each micro batch's counts 1 / micro batches of the step
    (it was counted once per micro batch), averaged over the ranks like the gradients."""
    for result in ranks2.run(router_loss_step, layout, micro_batches):
        assert result["loss"] <= 1e-5, result
