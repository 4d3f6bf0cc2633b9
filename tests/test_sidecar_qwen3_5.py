"""The Qwen3.5 sidecar: fp32 parity with plain transformers, a bf16 mixed-precision step with GatedDeltaNet's decay
and norm parameters kept fp32, and proof that the dtype-aware FSDP grouping is what makes that step possible.
"""

from __future__ import annotations

import pytest
import torch

from automodel.auto_model import NeMoAutoModelForCausalLM
from model_sidecars import sidecar_class
from model_sidecars.qwen3_5.model import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from model_sidecars.qwen3_5.parallelization import PARALLELIZER
from tests.cases import sidecar_qwen3_5 as cases

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return cases.save_checkpoint(str(tmp_path_factory.mktemp("qwen3_5")))


def _assert_parity(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["parallelizer_is_sidecar"], result
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"


@pytest.mark.distributed
def test_fsdp2_matches_plain_transformers(ranks4, checkpoint):
    _assert_parity(ranks4.run(cases.loaded_parity, checkpoint, {"strategy": "fsdp2"}))


@pytest.mark.distributed
def test_fsdp2_tp2_matches_plain_transformers(ranks4, checkpoint):
    """transformers' own Qwen3.5 plan applies: attention, MLP, GatedDeltaNet projections and the head."""
    results = ranks4.run(cases.loaded_parity, checkpoint, {"strategy": "fsdp2", "tp_size": 2})
    _assert_parity(results)
    sharded = results[0]["tp_sharded"]
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in sharded and "lm_head.weight" in sharded
    assert "model.layers.1.self_attn.q_proj.weight" in sharded and "model.layers.1.mlp.up_proj.weight" in sharded


@pytest.mark.distributed
def test_bf16_step_keeps_decay_and_norm_parameters_fp32(ranks4, checkpoint):
    for result in ranks4.run(cases.bf16_step, checkpoint):
        assert result["fp32"] == cases.FP32_PARAMETERS, result
        assert result["other_dtypes"] == ["torch.bfloat16"], result
        assert result["finite"], result
        assert abs(result["loss"] - result["reference_loss"]) < 5e-2, result
        assert all(len(dtypes) == 1 for dtypes in result["unit_dtypes"].values()), result["unit_dtypes"]
        # ... and they are computed in fp32 too (their unit's policy), not all-gathered in bf16.
        assert result["computed_in"] == dict.fromkeys(["A_log", "dt_bias", "norm.weight"], "torch.float32"), result


@pytest.mark.distributed
def test_default_parallelizer_mixes_dtypes_in_one_unit_and_fails(ranks4, checkpoint):
    result = ranks4.run(cases.default_versus_sidecar_bf16, checkpoint)[0]
    assert result["default"]["mixed_units"] == ["model.layers.0"], result
    assert "FSDP expects uniform original parameter dtype" in result["default"]["error"], result
    assert result["sidecar"] == {"mixed_units": [], "error": ""}, result


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return cases.save_checkpoint(str(tmp_path_factory.mktemp("qwen3_5_moe")), moe=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [{"strategy": "fsdp2", "ep_size": 2}, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}],
    ids=["ep2", "ep2_x_tp2"],
)
def test_moe_variant_under_expert_parallelism(ranks4, moe_checkpoint, layout):
    """Qwen3.5-MoE takes the unified MoE path with the sidecar's dtype-uniform units (its hook runs there)."""
    results = ranks4.run(cases.loaded_parity, moe_checkpoint, layout)
    _assert_parity(results)
    assert results[0]["hooks"] == ["_apply_fsdp_sharding@dp_shard_cp"], results[0]["hooks"]


@pytest.mark.distributed
def test_moe_variant_bf16_step_under_expert_parallelism(ranks4, moe_checkpoint):
    for result in ranks4.run(cases.bf16_step, moe_checkpoint, {"ep_size": 2}):
        assert result["fp32"] == cases.FP32_PARAMETERS, result
        assert result["finite"], result
        assert all(len(dtypes) == 1 for dtypes in result["unit_dtypes"].values()), result["unit_dtypes"]
        assert result["computed_in"] == dict.fromkeys(["A_log", "dt_bias", "norm.weight"], "torch.float32"), result


def test_registry_class_carries_the_sidecar():
    for cls in (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM):
        assert cls.parallelizer is PARALLELIZER
        assert sidecar_class(cls.__name__) is cls  # save_pretrained writes a name transformers and the registry know


def test_bf16_loading_keeps_fp32_parameters_where_transformers_does_not(checkpoint):
    import transformers

    def fp32(model):
        return sorted(name for name, p in model.named_parameters() if p.dtype == torch.float32)

    assert fp32(Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)) == cases.FP32_PARAMETERS
    assert fp32(transformers.Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)) == []
    # Built on the meta device by the parallel loader (construction alone does not apply the keep-in-fp32 list).
    config = cases.tiny_config(architectures=["Qwen3_5ForCausalLM"])
    meta = NeMoAutoModelForCausalLM._build_on_meta(config, torch.bfloat16, None, False)
    assert type(meta) is Qwen3_5ForCausalLM and fp32(meta) == cases.FP32_PARAMETERS
