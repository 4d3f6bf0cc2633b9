"""Splitting a model into pipeline stages (``automodel.distributed.pipeline_stages``), in one process: the roles
found from the call order on meta, the layer balance, and stages that chained give the plain model's logits."""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.model_structure import decoder_layers
from automodel.distributed.pipeline_stages import build_stage, pipeline_roles, stage_layer_counts
from tests.cases.pipeline import plain_model
from tests.tiny_models import token_batch


def test_roles_come_from_the_call_order():
    roles = pipeline_roles(plain_model("llama"))
    assert roles.layers == tuple(f"model.layers.{index}" for index in range(4))
    assert roles.inputs == ("model.embed_tokens",) and roles.outputs == ("model.norm", "lm_head")
    assert roles.layer_output_length is None
    # GPT-2: token and position embeddings are both inputs, its final norm and head the outputs.
    gpt2 = pipeline_roles(plain_model("gpt2"))
    assert gpt2.inputs == ("transformer.wte", "transformer.wpe") and gpt2.outputs == ("transformer.ln_f", "lm_head")


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (4, 2, [2, 2]),
        (8, 4, [2, 2, 2, 2]),
        (9, 2, [4, 5]),
        (32, 4, [8, 8, 8, 8]),
        (30, 4, [7, 8, 8, 7]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_layers_are_balanced_with_the_embeddings_and_head_counted(layers, stages, expected):
    counts = stage_layer_counts(layers, stages)
    assert counts == expected and sum(counts) == layers


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(ValueError, match="3 decoder layers and the pipeline 4 stages"):
        stage_layer_counts(3, 4)


#: RemBERT's embeddings are narrower than its layers (a later stage's forward gets zeros of the embeddings' shape as
#: ``inputs_embeds``, not the received activation).
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "mixtral", "bamba", "rembert"])
def test_chained_stages_give_the_plain_models_logits(model_type):
    """Each stage runs the model's own forward with other stages' parts stood in; chaining them is the model."""
    model = plain_model(model_type).eval()
    roles = pipeline_roles(model)
    counts = stage_layer_counts(roles.num_layers, 3 if roles.num_layers >= 3 else 2)
    bounds = [sum(counts[:index]) for index in range(len(counts) + 1)]
    stages = [
        build_stage(model, roles, range(bounds[i], bounds[i + 1]), first=i == 0, last=i == len(counts) - 1)
        for i in range(len(counts))
    ]
    batch = token_batch(4, 16)
    with torch.no_grad():
        expected = model(input_ids=batch).logits
        hidden = batch
        for stage in stages:
            hidden = stage(hidden)
    assert torch.equal(hidden, expected)
    held = [{name for name, _ in stage.named_parameters()} for stage in stages]
    assert set().union(*held) == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # A tied embedding and head are two names (the first and the last stage each hold one), every name once.
    assert sum(map(len, held)) == len(set().union(*held)), "a parameter is held by two stages"


def test_a_model_computing_its_own_loss_is_refused():
    # BartForCausalLM's loss takes labels already shifted: a pipelined train_step could not reproduce it.
    with pytest.raises(ValueError, match="does not compute transformers' causal-LM loss"):
        pipeline_roles(plain_model("bart"))


def test_router_auxiliary_loss_is_refused():
    model = plain_model("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True"):
        pipeline_roles(model)


def test_a_stage_of_a_model_without_declared_blocks_has_its_own_layers_as_blocks():
    # BioGPT declares no `_no_split_modules`: its blocks are the members of its layer list, of which a stage holds
    # some and stand-ins for the rest (FSDP units, activation checkpointing and compile take the stage's own).
    model = plain_model("biogpt")
    roles = pipeline_roles(model)
    stage = build_stage(model, roles, range(2, 4), first=False, last=True)
    assert decoder_layers(stage) == [stage.get_submodule(roles.layers[index]) for index in (2, 3)]


@pytest.mark.parametrize(
    ("model_type", "cause"),
    [
        ("gemma4_text", "'_AbsentEmbedding' object has no attribute 'weight'"),  # reads the embedding's weight
        ("roc_bert", "Attempting to broadcast a dimension"),  # adds inputs to the embeddings it concatenates
    ],
)
def test_a_stage_whose_forward_fails_on_meta_is_refused_when_built(model_type, cause):
    model = plain_model(model_type)
    roles = pipeline_roles(model)
    assert build_stage(model, roles, range(0, 2), first=True, last=False) is not None
    with pytest.raises(
        ValueError, match="cannot be split into pipeline stages: the stage of decoder layers 2-3"
    ) as error:
        build_stage(model, roles, range(2, 4), first=False, last=True)
    assert cause in str(error.value) and "Use pp_size=1" in str(error.value)


def test_the_check_before_launch_builds_every_stage(tmp_path):
    # RoCBERT's second stage cannot run: rank 0 holds the first stage, and the check before launch still refuses.
    from automodel.planning import layout_refusal

    plain_model("roc_bert").save_pretrained(tmp_path)
    why = layout_refusal(tmp_path, world_size=2, layout={"pp_size": 2, "pp_schedule": "1f1b"}, dtype="fp32")
    assert why is not None and "the stage of decoder layers 2-3 fails in its forward" in why, why
    assert layout_refusal(tmp_path, world_size=2, layout={}, dtype="fp32") is None


def test_a_parameter_shared_across_stages_is_refused(tmp_path):
    # Zamba's transformer block is one set of parameters used by several decoder layers: cut between them, each stage
    # would train its own copy. The tied embedding and head are the one exception (their gradients are summed).
    from automodel.planning import layout_refusal

    plain_model("zamba").save_pretrained(tmp_path)
    why = layout_refusal(tmp_path, world_size=2, layout={"pp_size": 2, "pp_schedule": "1f1b"}, dtype="fp32")
    assert why is not None and "held by stages [0, 1], whose gradients would not be summed" in why, why
    tied = tmp_path / "tied"
    plain_model("llama", tie=True).save_pretrained(tied)
    assert layout_refusal(tied, world_size=2, layout={"pp_size": 2, "pp_schedule": "1f1b"}, dtype="fp32") is None
