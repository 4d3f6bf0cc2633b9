"""The TP plan derived from a model's data flow on meta (``automodel.distributed.derived_tp_plan``), in one process.

Its parity under TP (every architecture of the zoo) is in ``tests/test_zoo_sweep.py``; a Llama with its plan removed
is run on two ranks in ``tests/test_parallelizer_hooks.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.distributed.derived_tp_plan import DERIVED_SOURCE, derive_tp_plan
from automodel.distributed.hf_plans import expand_plan, model_tp_plan
from automodel.distributed.tensor_parallel import MODEL_SOURCE, USER_SOURCE, choose_tp_plan, set_user_tp_plan
from tests.causal_lm_zoo import tiny_config

#: Models with a plan of their own: the derived plan must give each of their linear layers the same style.
DECLARED = ["llama", "qwen2", "mistral", "qwen3", "gemma2", "phi", "cohere", "granite", "starcoder2"]


def meta_model(model_type: str, **overrides) -> torch.nn.Module:
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def linear_styles(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The styles of the decoder layers' linear layers (the head's rule is decided apart: only an untied head is
    sharded by a derived plan)."""
    head = model.get_output_embeddings()
    linears = {
        name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and module is not head
    }
    return {name: style for name, style in expand_plan(model, plan).items() if name in linears}


@pytest.mark.parametrize("model_type", DECLARED)
def test_the_data_flow_gives_the_plans_transformers_authors_wrote(model_type):
    model = meta_model(model_type)
    assert linear_styles(model, derive_tp_plan(model, 2)) == linear_styles(model, model_tp_plan(model))


def test_pairs_are_found_without_names():
    """BERT's attention exit sits in another child (``attention.output.dense``) and its MLP spans two children of
    the layer (``intermediate`` -> ``output``); BART's projections are all square."""
    bert = derive_tp_plan(meta_model("bert-generation"), 2)
    assert bert == {
        "bert.encoder.layer.*.attention.self.query": "colwise",
        "bert.encoder.layer.*.attention.self.key": "colwise",
        "bert.encoder.layer.*.attention.self.value": "colwise",
        "bert.encoder.layer.*.attention.output.dense": "rowwise",
        "bert.encoder.layer.*.intermediate.dense": "colwise",
        "bert.encoder.layer.*.output.dense": "rowwise",
    } | ({"lm_head": "colwise_gather_output"} if "lm_head" in bert else {})
    bart = derive_tp_plan(meta_model("bart"), 2)
    assert bart["model.decoder.layers.*.self_attn.out_proj"] == "rowwise"
    assert bart["model.decoder.layers.*.fc1"] == "colwise" and bart["model.decoder.layers.*.fc2"] == "rowwise"
    # The cross-attention the causal forward never runs stays replicated.
    assert not any("encoder_attn" in key for key in bart)


def test_packed_and_folded_projections_stay_replicated():
    # Moshi's fc1 packs gate and up, viewed as (2, features) and indexed: its MLP stays replicated.
    moshi = derive_tp_plan(meta_model("moshi"), 2)
    assert "model.layers.*.mlp.fc1" not in moshi and "model.layers.*.self_attn.o_proj.linear" in moshi
    # OPT's attention folds a rank's missing heads into the sequence (view(batch, -1, num_heads, head_dim)): the
    # local-shape trial on an odd sequence length fails, so only its MLP is sharded.
    assert derive_tp_plan(meta_model("opt"), 2) == {
        "model.decoder.layers.*.fc1": "colwise",
        "model.decoder.layers.*.fc2": "rowwise",
    }


def test_heads_that_do_not_divide_keep_attention_replicated():
    plan = derive_tp_plan(meta_model("llama", num_attention_heads=4, num_key_value_heads=1), 2)
    assert not any("self_attn" in key for key in plan)
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("mamba", "backbone.layers.*.mixer.in_proj also feeds another linear layer"),
        ("bitnet", "one rank's local shapes do not run through its forward"),
    ],
)
def test_a_model_with_nothing_safe_to_shard_is_refused_naming_why(model_type, reason):
    model = meta_model(model_type)
    with pytest.raises(ValueError, match="none can be derived from its module tree") as error:
        derive_tp_plan(model, 2)
    assert type(model).__name__ in str(error.value) and reason in str(error.value), str(error.value)


def test_a_forward_that_fails_on_meta_is_refused_naming_the_module_it_fails_in():
    model = meta_model("llama")

    def needs_values(*args, **kwargs):
        raise NotImplementedError("Cannot copy out of meta tensor; no data!")

    model.model.layers[1].mlp.act_fn.forward = needs_values
    with pytest.raises(ValueError, match="none can be derived from its module tree") as error:
        derive_tp_plan(model, 2)
    assert (
        "cannot be traced on the meta device: it fails in model.layers.1.mlp.act_fn (SiLUActivation) with "
        "NotImplementedError: Cannot copy out of meta tensor" in str(error.value)
    ), str(error.value)


def test_gpt2_conv1d_mlp_is_sharded_and_its_packed_attention_stays_replicated():
    """GPT-2's ``Conv1D`` layers take part like linear ones; its fused ``c_attn`` (q, k and v in one weight, split)
    stays replicated, and its head is tied to the embedding, so only the MLP is sharded."""
    assert derive_tp_plan(meta_model("gpt2"), 2) == {
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
    }


def test_precedence_user_then_model_then_derived():
    model = meta_model("llama")
    assert choose_tp_plan(model, None, 2).source == MODEL_SOURCE
    model._tp_plan = {}
    derived = choose_tp_plan(model, None, 2)
    assert derived.source == DERIVED_SOURCE and derived.plan["model.layers.*.mlp.down_proj"] == "rowwise"
    set_user_tp_plan(model, {"model.layers.*.mlp.down_proj": "rowwise", "model.layers.*.mlp.up_proj": "colwise"})
    assert choose_tp_plan(model, None, 2).source == USER_SOURCE


def test_a_materialised_model_is_traced_on_a_meta_twin_and_left_untouched():
    config = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert derive_tp_plan(model, 2)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
