"""LoRA adapters (peft) through from_pretrained on every layout: the same logits, loss and adapter gradients as
peft's get_peft_model on plain transformers, frozen base weights, a merge that keeps the outputs, and adapter-only
checkpoints that peft loads and that load back onto another layout."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.cases.lora import (
    LORA,
    adapter_bytes,
    dropout_parity,
    load_adapter,
    lora_parity,
    merged_export,
    save_adapter,
)
from tests.tiny_models import save_tiny_checkpoint, token_batch

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
DENSE_LAYOUTS = {
    "fsdp2_dp4": {"strategy": "fsdp2"},
    "hsdp_2x2": {"strategy": "fsdp2", "dp_replicate_size": 2},
    "tp2": {"strategy": "fsdp2", "tp_size": 2},  # with dp_shard=2: FSDP2 x TP
    "tp2_sp": {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True},
    "hsdp_x_tp2": {"strategy": "fsdp2", "dp_replicate_size": 2, "tp_size": 2},
    "ddp": {"strategy": "ddp"},
}
MOE_LAYOUTS = {
    "ep2": {"strategy": "fsdp2", "ep_size": 2},
    "ep2_x_tp2": {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        arch: str(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}_lora")))
        for arch in ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")
    }


def _assert_parity(results: list[dict], adapted_layers: int) -> None:
    for result in results:
        assert result["initial"] <= 1e-6, "zero lora_B: the adapted model starts as the base model"
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result
        assert result["trainable"] and all(".lora_" in name for name in result["trainable"])
        assert len(result["trainable"]) == 2 * adapted_layers  # A and B of every adapted layer
        assert result["frozen_grads"] == [], "the base weights get no gradient"
        assert result["merged"] <= TOLERANCE and result["names_after_merge"], result


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", DENSE_LAYOUTS.values(), ids=DENSE_LAYOUTS.keys())
def test_lora_matches_peft_on_plain_transformers(ranks4, checkpoints, layout, architecture):
    _assert_parity(ranks4.run(lora_parity, checkpoints[architecture], layout), adapted_layers=3 * 2)


@pytest.mark.parametrize("architecture", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("layout", MOE_LAYOUTS.values(), ids=MOE_LAYOUTS.keys())
def test_lora_on_the_dense_modules_of_a_moe_model_under_ep(ranks4, checkpoints, layout, architecture):
    _assert_parity(ranks4.run(lora_parity, checkpoints[architecture], layout, "moe"), adapted_layers=3 * 2)


ALL_LINEAR_CASES = {
    # 7 linear layers a block (attention and MLP), colwise and rowwise alike, under TP with SP.
    "qwen3_tp2_sp": ("qwen3", {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}, 7 * 2),
    # Mixtral's experts and router are not linear modules: the 4 attention projections a block, under EP x TP.
    "mixtral_ep2_x_tp2": ("mixtral", {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}, 4 * 2),
}


@pytest.mark.parametrize("architecture,layout,adapted", ALL_LINEAR_CASES.values(), ids=ALL_LINEAR_CASES.keys())
def test_lora_on_all_linear_layers(ranks4, checkpoints, architecture, layout, adapted):
    _assert_parity(ranks4.run(lora_parity, checkpoints[architecture], layout, "all_linear"), adapted_layers=adapted)


def test_lora_dropout_draws_peft_masks_under_tp(ranks2, checkpoints):
    """lora_dropout=0.5 in training mode, TP=2: the replicated input of a colwise layer's lora_A is dropped with the
    rank's own generator, seeded alike on every rank, so the masks are those single-process peft draws."""
    for result in ranks2.run(dropout_parity, checkpoints["llama"], {"strategy": "fsdp2", "tp_size": 2}):
        assert max(result.values()) <= TOLERANCE, result


def test_adapter_round_trip(ranks4, ranks2, checkpoints, tmp_path):
    """Saved from FSDP2 x TP=2 on 4 ranks: peft's PeftModel.from_pretrained on plain transformers and a TP=2 model on
    2 ranks give the logits the sharded model had."""
    directory = tmp_path / "adapter"
    saved = ranks4.run(save_adapter, checkpoints["llama"], {"strategy": "fsdp2", "tp_size": 2}, str(directory))[0]
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(directory / "adapter_model.safetensors", "pt") as handle:
        keys = sorted(handle.keys())
    assert len(keys) == 12 and all(key.startswith("base_model.model.model.layers.") for key in keys), keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == LORA.r and config["inference_mode"] is True
    assert config["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    assert config["base_model_name_or_path"] == checkpoints["llama"]

    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoints["llama"]), directory)
    with torch.no_grad():
        peft_logits = plain(input_ids=token_batch()).logits
    assert (peft_logits - saved["logits"]).abs().max() <= TOLERANCE
    for result in ranks2.run(load_adapter, checkpoints["llama"], {"strategy": "fsdp2", "tp_size": 2}, str(directory)):
        assert (result["logits"] - saved["logits"]).abs().max() <= TOLERANCE
        assert len(result["trainable"]) == 12 and all(".lora_" in name for name in result["trainable"])


REFUSED_CONFIGS = {
    "expert_parameters": (
        {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]},
        "target_parameters",
    ),
    # peft turns "all-linear" on a model with fused experts into parameter targets (the experts, the router).
    "all_linear_on_fused_experts": ({"target_modules": "all-linear"}, r"target parameters.*e\.g\. target_modules="),
    "dora": ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
    "pissa_init": ({"target_modules": ["q_proj"], "init_lora_weights": "pissa"}, "init_lora_weights"),
    "modules_to_save": ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
    "trained_biases": ({"target_modules": ["q_proj"], "bias": "lora_only"}, r"bias='lora_only'.*lora_bias=True"),
    "trainable_tokens": ({"target_modules": ["q_proj"], "trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    "embedding": (
        {"target_modules": ["embed_tokens", "q_proj"]},
        r"linear layers only.*model\.embed_tokens \(Embedding\)",
    ),
}


@pytest.mark.parametrize("options,named", REFUSED_CONFIGS.values(), ids=REFUSED_CONFIGS.keys())
def test_unsupported_lora_configs_are_refused_before_loading(checkpoints, options, named):
    from peft import LoraConfig

    from automodel import NeMoAutoModelForCausalLM

    with pytest.raises(ValueError, match=named):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], peft_config=LoraConfig(r=4, **options))


def test_lora_refuses_megatron_fsdp():
    """Megatron-FSDP needs CUDA (refused earlier on CPU), so the check itself is exercised here."""
    from types import SimpleNamespace

    from automodel.distributed import MegatronFSDPConfig
    from automodel.lora import _check_layout
    from tests.cases.lora import LORA

    with pytest.raises(ValueError, match="megatron_fsdp"):
        _check_layout(LORA, SimpleNamespace(strategy=MegatronFSDPConfig()))


def test_adapters_follow_colwise_and_rowwise_layers_and_refuse_other_styles():
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    from automodel.distributed.adapters import LOCAL_INPUT_STYLE, adapter_placements

    model = nn.ModuleDict({"up": nn.Linear(4, 8), "down": nn.Linear(8, 4), "embed": nn.Embedding(10, 4)})
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["up", "down", "embed"]), model)
    plan = {"up": "colwise", "down": "rowwise"}
    assert adapter_placements(model, plan, sequence_parallel=False) == {
        "up.base_layer": "colwise",
        "up.lora_A.default": LOCAL_INPUT_STYLE,
        "up.lora_B.default": "colwise",
        "down.base_layer": "rowwise",
        "down.lora_A.default": "rowwise",
    }
    assert adapter_placements(model, plan, sequence_parallel=True)["down.lora_B.default"] == (
        "replicated_with_grad_allreduce"
    )
    with pytest.raises(ValueError, match="embed cannot follow its TP style 'embedding'"):
        adapter_placements(model, {**plan, "embed": "embedding"}, sequence_parallel=False)


@pytest.mark.parametrize(
    ("world", "layout"),
    [pytest.param(4, {"strategy": "fsdp2"}, marks=pytest.mark.slow), (4, {"strategy": "fsdp2", "tp_size": 2}),
     pytest.param(4, {"strategy": "fsdp2", "dp_replicate_size": 2}, marks=pytest.mark.slow)],
    ids=["fsdp2", "fsdp2_x_tp2", "hsdp"],
)  # fmt: skip
def test_the_saved_adapter_is_peft_save_pretrained_byte_for_byte_written_by_every_rank(
    request, checkpoints, tmp_path, world, layout
):
    results = request.getfixturevalue(f"ranks{world}").run(
        adapter_bytes, checkpoints["llama"], layout, str(tmp_path / "adapter")
    )
    assert results[0]["same_bytes"] and results[0]["factors"] == 12, results[0]
    assert all(result["bytes_written"] for result in results), [result["bytes_written"] for result in results]


MERGED_EXPORTS = {
    "lora_bias_fsdp2": ({"strategy": "fsdp2"}, {"target_modules": ["q_proj", "k_proj", "v_proj"], "lora_bias": True}),
    "lora_bias_tp2": ({"strategy": "fsdp2", "tp_size": 2}, {"target_modules": ["q_proj", "v_proj"], "lora_bias": True}),
    "pp2": ({"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 2}, {"target_modules": ["q_proj", "down_proj"]}),
    "lora_bias_pp2": (
        {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 2},
        {"target_modules": ["q_proj", "v_proj"], "lora_bias": True},
    ),
}


@pytest.mark.parametrize("layout,options", MERGED_EXPORTS.values(), ids=MERGED_EXPORTS.keys())
def test_a_merged_export_is_peft_merge_and_unload(ranks2, checkpoints, tmp_path, layout, options):
    """The adapters' biases (``lora_bias``) merge too, and under PP each stage merges its own layers."""
    (result, _) = ranks2.run(merged_export, checkpoints["qwen2"], layout, options, str(tmp_path / "merged"))
    assert result["logits"] <= TOLERANCE, result


def test_a_lora_bias_without_a_base_bias_and_an_unmerged_save_are_refused(ranks2, checkpoints, tmp_path):
    """Qwen2's o_proj has no bias: peft cannot merge an adapter bias there, nor can merge_lora. A model still carrying
    adapters is not saved as a transformers checkpoint (its names would be peft's)."""
    options = {"target_modules": ["q_proj", "o_proj"], "lora_bias": True}
    with pytest.raises(Exception, match=r"lora_bias=True into model\.layers\.0\.self_attn\.o_proj.*no bias"):
        ranks2.run(merged_export, checkpoints["qwen2"], {"strategy": "fsdp2"}, options, str(tmp_path / "a"))
    from tests.cases.lora import unmerged_save

    messages = ranks2.run(unmerged_save, checkpoints["qwen2"], str(tmp_path / "b"))
    assert len(set(messages)) == 1 and "merge_lora" in messages[0] and "save_lora_adapter" in messages[0], messages
    assert not (tmp_path / "b").exists()
