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


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"tp_size": 2, "sequence_parallel": True}], ids=["tp2", "tp2_sp"])
def test_a_model_without_a_plan_gets_the_one_its_data_flow_gives(ranks2, layout):
    """The plan derived from the module tree is transformers' own Llama plan (every projection colwise / rowwise,
    the head gathered), and the model matches plain transformers."""
    result = ranks2.run(hooks.derived_plan_parity, {"strategy": "fsdp2", **layout})[0]
    projections = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    expected = {f"model.layers.*.{name}": "colwise" for name in projections}
    expected |= {"model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.down_proj": "rowwise"}
    assert result["plan"] == {**expected, "lm_head": "colwise_gather_output"}, result["plan"]
    assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"tp_size": 2, "sequence_parallel": True}], ids=["tp2", "tp2_sp"])
def test_gpt2_conv1d_layers_shard_their_transposed_weights(ranks2, layout):
    """GPT-2's ``Conv1D`` (weight stored (in, out)): its derived plan shards the MLP (``c_fc`` colwise: weight on dim
    1, bias on dim 0; ``c_proj`` rowwise: weight on dim 0, bias replicated), the packed ``c_attn`` stays replicated,
    and the model matches plain transformers, with sequence parallelism too."""
    result = ranks2.run(hooks.gpt2_plan_parity, {"strategy": "fsdp2", **layout}, None)[0]
    assert result["plan"] == {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    assert result["placements"] == {
        "transformer.h.0.mlp.c_fc.weight": "S(1)",
        "transformer.h.0.mlp.c_fc.bias": "S(0)",
        "transformer.h.0.mlp.c_proj.weight": "S(0)",
        "transformer.h.0.mlp.c_proj.bias": "R",
    }, result["placements"]
    assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result


def test_a_conv1d_style_that_shards_another_way_is_refused_naming_it(ranks2):
    plan = {"transformer.h.*.mlp.c_fc": "packed_colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    messages = [
        result["error"] for result in ranks2.run(hooks.gpt2_plan_parity, {"strategy": "fsdp2", "tp_size": 2}, plan)
    ]
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("transformer.h.0.mlp.c_fc") and "is a Conv1D" in messages[0], messages[0]
    assert "'colwise' or 'rowwise'" in messages[0]


def test_a_planted_wrong_plan_is_refused_at_the_first_forward(ranks2):
    """A plan that shards the MLP's input projections but leaves ``down_proj`` replicated: the first forward refuses
    it naming ``down_proj``, instead of a shape error inside the MLP."""
    plan = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise"}
    messages = ranks2.run(hooks.wrong_plan_error, plan, {"strategy": "fsdp2", "tp_size": 2})
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("model.layers.0.mlp.down_proj (Linear, "), messages[0]
    assert "'rowwise'" in messages[0]


@pytest.mark.parametrize("planted", [None, "model.layers.1.post_attention_layernorm.weight"], ids=["clean", "planted"])
def test_the_first_backward_of_a_derived_plan_checks_replicated_gradients_agree(ranks2, planted):
    """Under a derived plan, a replicated parameter whose gradient differs between the TP ranks after the first
    backward is refused on every rank, naming it; a healthy model trains on."""
    messages = ranks2.run(hooks.derived_plan_backward, {"strategy": "fsdp2", "tp_size": 2}, planted)
    assert len(set(messages)) == 1, messages
    if planted is None:
        assert messages[0] == "no error"
    else:
        assert "got different gradients on the TP ranks" in messages[0] and planted in messages[0], messages[0]


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


# ------------------------------------------------------------------------------------ one flow, hooks on every path


def test_megatron_fsdp_refuses_a_sidecar_fsdp_primitive_before_touching_the_model(ranks2):
    for message in ranks2.run(hooks.path_refusal, "recording", {"strategy": "megatron_fsdp"}):
        assert message.startswith("ValueError: RecordingParallelizer overrides `_fully_shard_module`"), message
        assert "the Megatron-FSDP path" in message and "strategy='fsdp2'" in message, message
        assert message.endswith("(untouched=True)"), message


def test_moe_path_refuses_units_and_primitive_without_the_capability(ranks4):
    messages = ranks4.run(hooks.path_refusal, "units_and_primitive", {"strategy": "fsdp2", "ep_size": 2}, "mixtral")
    assert len(set(messages)) == 1, messages
    assert "UnitsAndPrimitiveParallelizer overrides `_apply_fsdp_sharding` and `_fully_shard_module`" in messages[0]
    assert "`_customizes_moe_fsdp = True`" in messages[0] and "unified MoE path (ep_size=2)" in messages[0]
    assert messages[0].endswith("(untouched=True)"), messages[0]


def test_ddp_runs_a_sidecar_with_fsdp_hooks_without_them(ranks2):
    """DDP has no FSDP units: the unit hooks have nothing to act on (rank 0 logs that); the model is replicated."""
    assert ranks2.run(hooks.path_refusal, "recording", {"strategy": "ddp"}) == ["no error"] * 2


def test_megatron_fsdp_with_context_parallel_is_refused_at_build(ranks2):
    for message in ranks2.run(hooks.build_error, {"strategy": "megatron_fsdp", "cp_size": 2}):
        assert message.startswith("ValueError: strategy='megatron_fsdp' with cp_size=2 is not supported"), message


@pytest.mark.parametrize(
    ("layout", "architecture", "expected"),
    [
        (
            {"strategy": "fsdp2", "tp_size": 2, "activation_checkpointing": True},
            "llama",
            [
                "Parallelizing LlamaForCausalLM with ModelParallelizer on the dense FSDP2 path",
                "TP over tp=2 (plan: 9 rules from the model)",
                "AC full on 4 modules of 2 blocks",
                "compile: off (auto, cpu)",
                "FSDP2 units: 2 layers + embeddings + LlamaRMSNorm + head + root over dp_shard_cp=2; reshard after "
                "forward: all but the last layer and the head; layers prefetch",
            ],
        ),
        (
            {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2, "activation_checkpointing": "selective"},
            "mixtral",
            [
                "Parallelizing MixtralForCausalLM with ModelParallelizer on the unified MoE path (ep_size=2)",
                "TP over tp=2 (plan: 6 rules from the model)",
                "EP over ep=2: 2 experts modules",
                "AC selective on 4 modules of 2 blocks",
                "compile: off (auto, cpu)",
                "FSDP2 units: 2 experts over ep_shard=2; 2 layers + embeddings + MixtralRMSNorm + head + root over "
                "dp_shard_cp=2; reshard after forward: all but the last layer and the head; "
                "layers prefetch",
            ],
        ),
        (
            {"strategy": "ddp", "activation_checkpointing": True},
            "llama",
            [
                "Parallelizing LlamaForCausalLM with ModelParallelizer on the DDP path",
                "AC full on 4 modules of 2 blocks",
                "compile: off (auto, cpu)",
                "DDP over dp=4",
            ],
        ),
    ],
    ids=["fsdp2_tp_ac", "ep_tp_sac", "ddp_ac"],
)
def test_rank_zero_logs_one_line_per_applied_step(ranks4, layout, architecture, expected):
    lines = ranks4.run(hooks.parallelize_log, layout, architecture)
    assert lines[0] == expected, lines[0]
    assert lines[1:] == [[], [], []]


def test_model_without_declared_blocks_uses_its_repeated_blocks(ranks4):
    """`_no_split_modules` cleared: the decoder layers are still the FSDP units and the AC blocks, found in the
    module tree, and the model matches plain transformers."""
    for result in ranks4.run(hooks.without_declared_blocks, {"strategy": "fsdp2", "activation_checkpointing": True}):
        assert result["units"] == [
            "",
            "lm_head",
            "model.embed_tokens",
            "model.layers.0",
            "model.layers.1",
            "model.norm",
        ]
        assert result["checkpointed"] == [f"model.layers.{i}.{block}" for i in (0, 1) for block in ("mlp", "self_attn")]
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result
