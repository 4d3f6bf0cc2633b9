"""DeepSeek-V4 sidecar: float32-kept parameters get float32 FSDP units (dense and MoE paths), parity with plain
transformers (fp32), a bf16 mixed-precision step, and proof that the default parallelizer cannot do this."""

from __future__ import annotations

import math

import pytest

from tests.cases.sidecar_deepseek_v4 import (
    bf16_step,
    default_vs_sidecar,
    kept_parameter_rule,
    loaded_parity,
    save_deepseek_v4_checkpoint,
)

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_deepseek_v4_checkpoint(tmp_path_factory.mktemp("deepseek_v4")))


def test_sidecar_keeps_exactly_what_transformers_keeps_in_fp32():
    kept = kept_parameter_rule()
    assert kept["sidecar"] == kept["by_path"] == kept["by_dtype"], kept
    assert any(name.endswith("sinks") for name in kept["sidecar"]) and "model.norm.weight" in kept["sidecar"]


def _assert_parity(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["sidecar"], "the registry must map DeepseekV4ForCausalLM to the sidecar class"
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        # Only the Lightning Indexer (it returns top-k indices) gets no gradient, here as in plain transformers.
        assert result["no_grad"] == result["ref_no_grad"] and all(".indexer." in n for n in result["no_grad"]), result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
        # Norms, mHC mixers, sinks and position biases sit in float32 units in every layer and in the root.
        assert "model.layers.0.attn_hc" in result["fp32_units"], result["fp32_units"]
        assert "model.layers.1.self_attn" in result["fp32_units"], result["fp32_units"]
        assert "model" in result["fp32_units"], result["fp32_units"]  # DeepseekV4Model around hc_head


@pytest.mark.parametrize(
    "layout", [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "tp_size": 2}], ids=["fsdp2_dp4", "fsdp2_tp_2x2"]
)
def test_loaded_parity(ranks4, checkpoint, layout):
    results = ranks4.run(loaded_parity, checkpoint, layout)
    _assert_parity(results)
    assert all(call.endswith("('dp_shard_cp',)") for call in results[0]["shard_calls"]), results[0]["shard_calls"]


def test_moe_path_uses_the_sidecar_primitive(ranks4, checkpoint):
    results = ranks4.run(loaded_parity, checkpoint, {"strategy": "fsdp2", "ep_size": 2})
    _assert_parity(results)
    calls = results[0]["shard_calls"]
    # The experts first, over ep_shard, through the sidecar's primitive; then the dense units and the root.
    assert calls[:3] == ["DeepseekV4Experts@('ep_shard',)"] * 3, calls
    dense = calls[3:]
    assert dense.count("DeepseekV4DecoderLayer@('dp_shard_cp',)") == 3, calls
    assert all(call.endswith("('dp_shard_cp',)") for call in dense), calls
    assert dense[-1] == "DeepseekV4ForCausalLM@('dp_shard_cp',)", calls


@pytest.mark.parametrize(
    "layout",
    [
        {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
        # Sequence parallelism has one answer on both paths: the mHC mixers, the attention (which the plan leaves
        # replicated) and the routed-experts block run on the whole sequence, the norms on sequence shards.
        {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True},
        {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2, "sequence_parallel": True},
    ],
    ids=["ep2_x_tp2", "tp2_sp", "ep2_x_tp2_sp"],
)
def test_tensor_and_expert_parallel_layouts(ranks4, checkpoint, layout):
    results = ranks4.run(loaded_parity, checkpoint, layout)
    _assert_parity(results)
    calls = results[0]["shard_calls"]
    if layout.get("ep_size", 1) > 1:
        assert calls[:3] == ["DeepseekV4Experts@('ep_shard',)"] * 3, calls


def test_bf16_step_keeps_fp32_parameters_fp32(ranks4, checkpoint):
    for result in ranks4.run(bf16_step, checkpoint):
        assert result["n_kept"] > 0 and result["n_computed"] == result["n_params"], result
        assert result["stored_kept"] == ["torch.float32"] and result["compute_kept"] == ["torch.float32"], result
        assert result["stored_rest"] == ["torch.bfloat16"] and result["compute_rest"] == ["torch.bfloat16"], result
        assert result["loss_finite"] and result["grads_finite"] and result["params_finite"], result
        # The same loss as plain transformers' bf16 model (which computes these parameters in fp32 too).
        assert abs(result["loss"] - result["ref_loss"]) < 1e-2, result
        assert "model.layers.2.ffn_hc" in result["fp32_units"] and "model.norm" in result["fp32_units"], result
        assert "" not in result["fp32_units"], "the root keeps the policy it was given"


def test_default_parallelizer_refuses_the_bf16_model_the_sidecar_shards(ranks4, checkpoint):
    default = ranks4.run(default_vs_sidecar, checkpoint, "bfloat16", False)
    for message in (result["error"] for result in default):  # every rank refuses (the dtype set prints in any order)
        assert message is not None and "FSDP expects uniform original parameter dtype" in message, message
        assert "torch.bfloat16" in message and "torch.float32" in message, message
    sidecar = ranks4.run(default_vs_sidecar, checkpoint, "bfloat16", True)
    assert all(r["error"] is None and math.isfinite(r["loss"]) for r in sidecar), sidecar
    assert sidecar[0]["compute_kept"] == ["torch.float32"], sidecar[0]


def test_default_parallelizer_computes_fp32_kept_parameters_in_bf16(ranks4, checkpoint):
    # An fp32 model has one dtype, so the default shards it, but its bf16 policy casts sinks, norms and mHC to bf16.
    default = ranks4.run(default_vs_sidecar, checkpoint, "float32", False)
    assert default[0]["error"] is None and default[0]["compute_kept"] == ["torch.bfloat16"], default[0]
    sidecar = ranks4.run(default_vs_sidecar, checkpoint, "float32", True)
    assert sidecar[0]["error"] is None and sidecar[0]["compute_kept"] == ["torch.float32"], sidecar[0]
