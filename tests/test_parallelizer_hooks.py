"""The sidecar hooks, the dispatch table and the errors of ``ModelParallelizer.parallelize`` on CPU ranks."""

from __future__ import annotations

import pytest

from tests.cases import hooks

pytestmark = pytest.mark.distributed


def test_sidecar_fully_shard_module_is_used_for_every_unit(ranks4):
    for result in ranks4.run(hooks.sidecar_fully_shard_module_is_used, {"strategy": "fsdp2"}):
        expected = ["LlamaDecoderLayer", "LlamaDecoderLayer", "Embedding", "LlamaRMSNorm", "Linear", "LlamaForCausalLM"]
        assert result["sharded"] == expected
        assert sorted(result["fsdp_units"]) == sorted(result["sharded"])
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result


def test_sidecar_fully_shard_module_is_used_with_tp_and_hsdp(ranks4):
    layout = {"strategy": "fsdp2", "dp_replicate_size": 2, "tp_size": 2}
    for result in ranks4.run(hooks.sidecar_fully_shard_module_is_used, layout):
        assert result["sharded"][-1] == "LlamaForCausalLM"
        assert result["sharded"].count("LlamaDecoderLayer") == 2
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result


def test_validate_tp_mesh_override_stops_parallelization(ranks2):
    for result in ranks2.run(hooks.validate_tp_mesh_can_stop):
        assert result["error"] == "this model cannot use TP over 2 ranks"
        assert result["untouched"]


@pytest.mark.parametrize(
    ("full_layers", "expected"), [(False, ["LlamaAttention", "LlamaMLP"]), (True, ["LlamaDecoderLayer"])]
)
def test_activation_checkpointing_granularity_follows_the_hook(ranks2, full_layers, expected):
    for result in ranks2.run(hooks.activation_checkpointing_granularity, full_layers):
        assert result["checkpointed"] == expected
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result


def test_heads_not_divisible_by_tp_names_module_and_numbers(ranks2):
    # 3 heads of 16 over 2 TP ranks
    overrides = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}
    messages = ranks2.run(hooks.parallelize_error, overrides, {"strategy": "fsdp2", "tp_size": 2})
    assert len(set(messages)) == 1
    assert "model.layers.0.self_attn" in messages[0]
    assert "num_attention_heads=3" in messages[0] and "tp_size=2" in messages[0]


def test_missing_tp_plan_names_the_class_and_how_to_supply_one(ranks2):
    message = ranks2.run(hooks.parallelize_error, {}, {"strategy": "fsdp2", "tp_size": 2}, "none")[0]
    assert "LlamaForCausalLM has no tensor-parallel plan" in message
    assert "_tp_plan" in message and "tp_shard_plan" in message


def test_sequence_parallel_refuses_a_style_it_cannot_follow(ranks2):
    plan = {"model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.down_proj": "colwise_gather_output"}
    layout = {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}
    message = ranks2.run(hooks.parallelize_error, {}, layout, plan)[0]
    assert "'colwise_gather_output' of model.layers.0.mlp.down_proj" in message


def test_sequence_parallel_needs_a_divisible_sequence(ranks2):
    layout = {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}
    message = ranks2.run(hooks.forward_error, layout, 7)[0]
    assert "sequence length (7)" in message and "tp_size (2)" in message


def test_megatron_fsdp_maps_its_config_and_refuses_cpu_before_touching_the_model(ranks2):
    for result in ranks2.run(hooks.megatron_on_cpu):
        assert "needs CUDA GPUs" in result["error"]
        assert result["untouched"]
        assert result["units"] == ["LlamaDecoderLayer"]
        assert (result["dp_shard_dim"], result["tp_dim"], result["dp_outer_dim"]) == ("dp_shard_cp", "tp", None)
        assert result["zero_dp_strategy"] == 2
        assert result["meta_init"] is False


def test_fully_shard_by_dtype_makes_dtype_uniform_units(ranks2):
    for result in ranks2.run(hooks.dtype_grouping):
        assert result["units"] == {"<root>": ["torch.bfloat16"], "gate": ["torch.float32"]}
        assert result["grads"]
