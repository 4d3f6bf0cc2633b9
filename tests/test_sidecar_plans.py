"""The sidecars that correct transformers' TP plan of a model (Doge, Gemma 3n text, the Gemma 4 composite): what the
plan changes, and on 2 CPU ranks (TP=2) that the default parallelizer fails on the model where the sidecar matches
plain transformers (fp32, logits / loss / every gradient within 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_sidecars import sidecar_class
from tests.cases.sidecar_plans import gemma4_moe_parity
from tests.cases.zoo import default_versus_sidecar
from tests.causal_lm_zoo import tiny_config

TOLERANCE = 1e-4
SIDECARS = {"doge": "DogeForCausalLM", "gemma3n_text": "Gemma3nForCausalLM", "gemma4": "Gemma4ForConditionalGeneration"}


def _meta_model(model_type: str, **overrides) -> torch.nn.Module:
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config.get_text_config(), key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _sidecar_plan(model: torch.nn.Module) -> dict[str, str]:
    parallelizer = sidecar_class(type(model).__name__).parallelizer
    return parallelizer._tp_plan(model)


@pytest.mark.parametrize(("model_type", "architecture"), SIDECARS.items())
def test_registry_maps_the_architecture_to_its_sidecar(model_type, architecture):
    model = _meta_model(model_type)
    assert type(model).__name__ == architecture
    cls = sidecar_class(architecture)
    assert cls.__name__ == architecture and issubclass(cls, type(model)) and cls.parallelizer is not None


def test_doge_plan_keeps_the_attention_replicated():
    model = _meta_model("doge")
    plan = _sidecar_plan(model)
    assert not [rule for rule in plan if ".self_attn." in rule], plan
    assert plan["model.layers.*.mlp.up_proj"] == "colwise" and plan == {
        rule: style for rule, style in model.tp_plan.items() if ".self_attn." not in rule
    }


def test_gemma3n_plan_shards_only_the_mlps_without_activation_sparsity():
    model = _meta_model("gemma3n_text", activation_sparsity_pattern=[0.95, 0.0])
    plan = _sidecar_plan(model)
    assert "model.layers.*.mlp.gate_proj" not in plan and "model.layers.0.mlp.gate_proj" not in plan
    assert plan["model.layers.1.mlp.gate_proj"] == "colwise" and plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"


@pytest.mark.parametrize("per_layer_input", [64, 0])
def test_gemma4_plan_replicates_the_tied_embedding_only_with_per_layer_inputs(per_layer_input):
    model = _meta_model("gemma4", hidden_size_per_layer_input=per_layer_input)
    plan = _sidecar_plan(model)
    kept = {"lm_head", "model.language_model.embed_tokens"} <= set(plan)
    assert kept == (per_layer_input == 0), plan
    assert plan["model.language_model.layers.*.mlp.gate_proj"] == "colwise"


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", SIDECARS)
def test_default_plan_fails_where_the_sidecar_matches_transformers(ranks2, model_type):
    for result in ranks2.run(default_versus_sidecar, model_type, {"strategy": "fsdp2", "tp_size": 2}):
        default, sidecar = result["default"], result["sidecar"]
        assert sidecar["status"] == "ok", sidecar
        assert not sidecar["tensor_differences"], sidecar
        assert max(sidecar["logits"], sidecar["loss"], sidecar["grad"]) <= TOLERANCE, sidecar
        # transformers' own plan: a shape error (Doge), a mixed DTensor read (Gemma 4), wrong numbers (Gemma 3n).
        failed = default["status"] != "ok" or max(default["logits"], default["grad"]) > 100 * TOLERANCE
        assert failed, default


@pytest.mark.distributed
def test_gemma4_sidecar_plan_holds_under_expert_parallelism(ranks4):
    """With its MoE block on, Gemma 4 takes the unified MoE path: the sidecar's plan (embedding and head replicated)
    minus the expert rules (EP owns the experts) is what TP applies, and the model matches plain transformers."""
    for result in ranks4.run(gemma4_moe_parity, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result
        assert not result["grad_presence"], result
        plan = result["plan"]
        assert not [rule for rule in plan if rule.endswith(("embed_tokens", "lm_head")) or ".experts" in rule], plan
        assert plan["model.language_model.layers.*.mlp.gate_proj"] == "colwise", plan
