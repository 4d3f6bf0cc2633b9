"""The Nemotron-H sidecar: parity with plain transformers, and proof that each of its overrides matters.

A tiny random hybrid checkpoint (Mamba-2, attention, MLP and MoE blocks) is loaded through
``NeMoAutoModelForCausalLM.from_pretrained`` on 4 CPU ranks; logits, loss and every gradient must match plain
transformers within 1e-4 (fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_sidecars.nemotron_h.model import NemotronHForCausalLM
from model_sidecars.nemotron_h.parallelization import PARALLELIZER, _decoder_blocks, _tp_plan
from tests.cases import sidecar_nemotron_h as cases

TOLERANCE = 1e-4
SIDECAR_TP = ["attention_o", "attention_q", "experts_up", "lm_head", "mlp_down", "mlp_up", "shared_up"]
CHECKPOINTED = ["model.layers.0.mixer", "model.layers.2.mixer", "model.layers.3.mixer"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return cases.save_checkpoint(str(tmp_path_factory.mktemp("nemotron_h")))


def _assert_parity(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["parallelizer_is_sidecar"], result
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"


@pytest.mark.distributed
def test_fsdp2_matches_plain_transformers(ranks4, checkpoint):
    results = ranks4.run(cases.loaded_parity, checkpoint, {"strategy": "fsdp2"})
    _assert_parity(results)
    assert results[0]["tp_sharded"] == [] and results[0]["checkpointed"] == []
    # One unit per decoder block, the embeddings, the head and the root.
    assert len(results[0]["fsdp_units"]) == len(cases.LAYER_TYPES) + 3, results[0]["fsdp_units"]


@pytest.mark.distributed
def test_fsdp2_tp2_shards_mlp_moe_attention_and_head_but_not_mamba(ranks4, checkpoint):
    results = ranks4.run(cases.loaded_parity, checkpoint, {"strategy": "fsdp2", "tp_size": 2})
    _assert_parity(results)
    assert results[0]["tp_sharded"] == SIDECAR_TP  # mamba_in_proj stays replicated over TP


@pytest.mark.distributed
def test_activation_checkpointing_covers_exactly_mlp_moe_and_mamba(ranks4, checkpoint):
    layout = {"strategy": "fsdp2", "tp_size": 2, "activation_checkpointing": True}
    results = ranks4.run(cases.loaded_parity, checkpoint, layout)
    _assert_parity(results)
    # Mamba (0), MLP (2), MoE (3) mixers; not the attention mixer (1), nor whole blocks.
    assert results[0]["checkpointed"] == CHECKPOINTED


@pytest.mark.distributed
def test_sidecar_plan_and_checkpointing_differ_from_the_default_parallelizer(ranks4, checkpoint):
    """transformers' own plan shards only the embeddings and routed experts: with the default parallelizer the MLP,
    shared experts, attention and head stay unsharded, and the default AC also recomputes attention."""
    result = ranks4.run(cases.default_versus_sidecar, checkpoint)[0]
    assert result["default"]["tp_sharded"] == ["experts_up"], result
    assert result["sidecar"]["tp_sharded"] == SIDECAR_TP, result
    assert "model.layers.1.mixer" in result["default"]["checkpointed"], result
    assert result["sidecar"]["checkpointed"] == CHECKPOINTED, result


@pytest.mark.distributed
def test_dtype_uniform_units_make_bf16_with_the_fp32_router_work(ranks4, checkpoint):
    """In bf16 the MoE router weight stays fp32 (transformers >= 5.24 builds it so): the default unit per block mixes
    dtypes, which FSDP2 refuses; the sidecar gives the router its own unit. Where transformers keeps nothing in fp32
    (5.23), both parallelizers run and keep every parameter in bf16, as transformers does."""
    result = ranks4.run(cases.bf16_default_versus_sidecar, checkpoint)[0]
    assert result["sidecar"]["fp32"] == result["transformers_fp32"], result
    assert result["transformers_fp32"] in ([], ["model.layers.3.mixer.gate.weight"]), result
    if result["transformers_fp32"]:
        assert result["default"]["mixed_units"] == ["model.layers.3"], result
        assert "FSDP expects uniform original parameter dtype" in result["default"]["error"], result
    else:
        assert result["default"]["mixed_units"] == [] and result["default"]["error"] == "", result
    assert result["sidecar"]["mixed_units"] == [] and result["sidecar"]["error"] == "", result


@pytest.mark.distributed
def test_context_parallel_is_refused_with_the_reason(ranks4, checkpoint):
    messages = ranks4.run(cases.refusal, checkpoint, {"strategy": "fsdp2", "cp_size": 2})
    assert len(set(messages)) == 1
    assert "Context parallelism is not supported for Nemotron-H (NemotronHForCausalLM)" in messages[0]
    assert "Mamba-2" in messages[0] and "cp_size=1" in messages[0]


@pytest.mark.distributed
def test_sequence_parallel_is_refused_with_the_reason(ranks4, checkpoint):
    messages = ranks4.run(cases.refusal, checkpoint, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True})
    assert len(set(messages)) == 1
    assert "Sequence parallelism is not supported for Nemotron-H" in messages[0]
    assert "sequence_parallel=False" in messages[0]


# The unified MoE path: the sidecar's `_apply` (refusals, AC on the mixers, its TP plan) and its dtype-uniform units
# hold there too; EP owns the routed experts instead of TP.
EP_LAYOUTS = {
    "ep2": {"strategy": "fsdp2", "ep_size": 2},
    "ep2_full_ac": {"strategy": "fsdp2", "ep_size": 2, "activation_checkpointing": "full"},
    "ep2_x_tp2": {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", EP_LAYOUTS.values(), ids=EP_LAYOUTS.keys())
def test_expert_parallel_keeps_the_sidecar_policy(ranks4, checkpoint, layout):
    results = ranks4.run(cases.loaded_parity, checkpoint, layout)
    _assert_parity(results)
    result = results[0]
    assert result["hooks"] == ["_apply", "_apply_fsdp_sharding@dp_shard_cp"], result["hooks"]
    tp = layout.get("tp_size", 1) > 1
    assert result["tp_sharded"] == ([name for name in SIDECAR_TP if name != "experts_up"] if tp else []), result
    assert result["checkpointed"] == (CHECKPOINTED if layout.get("activation_checkpointing") else []), result
    # The experts are a unit of their own (over ep_shard), inside the sidecar's per-block units.
    assert "model.layers.3.mixer.experts" in result["fsdp_units"], result["fsdp_units"]
    assert all(f"model.layers.{i}" in result["fsdp_units"] for i in range(len(cases.LAYER_TYPES)))


@pytest.mark.distributed
def test_sequence_parallel_gets_the_same_refusal_with_and_without_ep(ranks4, checkpoint):
    dense = ranks4.run(cases.refusal, checkpoint, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True})
    moe = ranks4.run(
        cases.refusal, checkpoint, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2, "sequence_parallel": True}
    )
    assert set(dense) == set(moe) and len(set(moe)) == 1, (dense, moe)
    assert "Sequence parallelism is not supported for Nemotron-H" in moe[0]


@pytest.mark.distributed
def test_bf16_step_under_ep_keeps_the_dtype_uniform_units(ranks4, checkpoint):
    """Without the sidecar's units this fails exactly as the issue reported: "FSDP expects uniform original
    parameter dtype but got {torch.bfloat16, torch.float32}"."""
    for result in ranks4.run(cases.bf16_step, checkpoint, {"ep_size": 2}):
        assert result["fp32"] == result["transformers_fp32"], result
        assert result["mixed_units"] == [] and result["experts_unit"], result
        assert result["loss_finite"] and result["grads_finite"], result


@pytest.mark.distributed
def test_user_tp_plan_overrides_the_sidecar_plan(ranks4, checkpoint):
    """`from_pretrained(tp_plan=...)` > the sidecar's plan > the model's own: only the MLP is sharded here."""
    plan = {"model.layers.*.mixer.up_proj": "colwise", "model.layers.*.mixer.down_proj": "rowwise"}
    results = ranks4.run(cases.loaded_parity, checkpoint, {"strategy": "fsdp2", "tp_size": 2}, plan)
    _assert_parity(results)
    assert results[0]["tp_sharded"] == ["mlp_down", "mlp_up"], results[0]


@pytest.mark.distributed
def test_user_tp_plan_rule_that_matches_nothing_is_an_error(ranks4, checkpoint):
    plan = {"model.layers.*.mixer.up_projection": "colwise", "model.layers.*.mixer.down_proj": "rowwise"}
    messages = ranks4.run(cases.refusal, checkpoint, {"strategy": "fsdp2", "tp_size": 2}, plan)
    assert len(set(messages)) == 1, messages
    assert "tp_plan rules ['model.layers.*.mixer.up_projection'] match no parameter or module" in messages[0]
    assert "NemotronHForCausalLM" in messages[0]


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return NemotronHForCausalLM._from_config(cases.tiny_config())


class _RemoteCodeLayout(nn.Module):
    """The original remote-code layout: ``backbone.{embeddings,layers,norm_f}`` and ``lm_head``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.config = model.config
        self.backbone = model.model
        self.lm_head = model.lm_head

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_registry_class_carries_the_sidecar():
    assert NemotronHForCausalLM.parallelizer is PARALLELIZER
    assert NemotronHForCausalLM.__name__ == "NemotronHForCausalLM"  # save_pretrained writes a known architecture


def test_decoder_blocks_on_both_layouts():
    model = _meta_model()
    container, blocks = _decoder_blocks(model)
    assert container is model.model.layers and blocks == list(model.model.layers)
    remote = _RemoteCodeLayout(model)
    container, blocks = _decoder_blocks(remote)
    assert container is remote.backbone.layers and [b.block_type for b in blocks] == cases.LAYER_TYPES
    with pytest.raises(ValueError, match="no Nemotron-H decoder container"):
        _decoder_blocks(nn.Linear(2, 2))


def test_tp_plan_follows_the_layout_and_leaves_mamba_replicated():
    plan = _tp_plan(_RemoteCodeLayout(_meta_model()), 2)
    assert plan["backbone.embeddings"] == "embedding_rowwise"
    assert plan["backbone.layers.*.mixer.up_proj"] == "colwise"
    assert plan["backbone.layers.*.mixer.q_proj"] == "colwise"
    assert not any("in_proj" in key or "conv1d" in key or "A_log" in key for key in plan)


def test_tp_plan_leaves_attention_replicated_when_heads_do_not_divide():
    model = _meta_model()
    model.config.num_key_value_heads = 1
    plan = _tp_plan(model, 2)
    assert "model.layers.*.mixer.q_proj" not in plan and plan["model.layers.*.mixer.up_proj"] == "colwise"
