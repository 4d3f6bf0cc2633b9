"""Vision-language models and sequence classifiers loaded by the auto classes, against plain transformers.

Each tiny random vision-language checkpoint (``tests/vlm_models.py``) is written by ``save_pretrained``, which in
transformers 5.24 writes the older multimodal key layouts (``language_model.model.*``, ``vision_tower.*``, Qwen2.5-VL's
``model.layers.*`` / ``visual.*``): every load below goes through transformers' checkpoint conversion mapping. With
image + text inputs, logits, loss and every gradient must agree within 1e-4 (fp32) on 4 CPU ranks under FSDP2, HSDP,
TP=2 and FSDP2 x TP=2 (+ activation checkpointing on both towers, + sequence parallelism on the language decoder).
The vision encoder blocks must be FSDP units of their own and stay replicated over ``tp``.
"""

from __future__ import annotations

import pytest

from tests.cases.vlm import (
    sequence_classification_parity,
    vlm_bytes_read_per_rank,
    vlm_generate,
    vlm_parity,
    vlm_refusal,
)
from tests.vlm_models import VLM_ARCHITECTURES, build_vlm, save_tiny_vlm, tiny_vlm_config

TOLERANCE = 1e-4

LAYOUTS = {
    "fsdp2_dp4": (4, {"strategy": "fsdp2"}),
    "hsdp_2x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_tp_2x2": (4, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_tp_2x2_ac": (4, {"strategy": "fsdp2", "tp_size": 2, "activation_checkpointing": "full"}),
    "tp2_sp": (2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
    "fsdp2_tp_sp_2x2_ac": (
        4,
        {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
    ),
    "fsdp2_tp_sp_2x2_sac": (
        4,
        {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True, "activation_checkpointing": "selective"},
    ),
}
QUICK = {
    ("llava", "fsdp2_tp_2x2"),
    ("qwen2_5_vl", "fsdp2_tp_2x2_ac"),
    ("idefics3", "hsdp_2x2"),
    ("qwen3_vl", "fsdp2_tp_sp_2x2_ac"),
    ("qwen3_vl", "fsdp2_tp_sp_2x2_sac"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved checkpoint per architecture, shared by every layout."""
    return {arch: str(save_tiny_vlm(arch, tmp_path_factory.mktemp(arch))) for arch in VLM_ARCHITECTURES}


def _matrix():
    for arch in VLM_ARCHITECTURES:
        for name, (world, layout) in LAYOUTS.items():
            marks = [pytest.mark.distributed] + ([] if (arch, name) in QUICK else [pytest.mark.slow])
            yield pytest.param(arch, world, layout, id=f"{arch}-{name}", marks=marks)


def _assert_parity(results: list[dict], layout: dict) -> None:
    for rank, result in enumerate(results):
        assert result["on_meta"] == [] and result["buffers"] == 0.0, result
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        assert result["grad_presence"] == [] and not result["nan"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
        assert result["sharded"] > 0, result


@pytest.mark.parametrize(("arch", "world", "layout"), _matrix())
def test_vision_language_model_matches_plain_transformers(request, checkpoints, arch, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    results = pool.run(vlm_parity, checkpoints[arch], layout)
    _assert_parity(results, layout)
    for result in results:
        # Two encoder layers (+ the vision embeddings where the model declares them a block of their own).
        assert result["vision_blocks"] >= 2, result
        sharded = layout.get("tp_size", 1) < world
        assert result["vision_units"] == (result["vision_blocks"] if sharded else 0), "vision blocks are FSDP units"
        if layout.get("tp_size", 1) > 1:
            assert result["vision_replicated_over_tp"], "the vision tower stays replicated over tp"
        if layout.get("activation_checkpointing"):
            assert result["vision_checkpointed"] >= 2, "activation checkpointing covers the vision blocks"
        # The language decoder's layers run on sequence shards under SP (their norms see half the sequence).
        shard = result["seq"] // 2 if layout.get("sequence_parallel") else result["seq"]
        assert result["norm_lengths"] and set(result["norm_lengths"]) == {shard}, result["norm_lengths"]


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_each_rank_reads_only_its_shards(ranks4, checkpoints, arch):
    """Through the conversion mapping of an older key layout, each rank reads exactly what it stores."""
    for result in ranks4.run(vlm_bytes_read_per_rank, checkpoints[arch], {"strategy": "fsdp2"}):
        assert result["read"] == result["local"], result
        assert result["read"] <= result["total"] / 4 * 1.05, result


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "tp_size": 2}], ids=["fsdp2", "tp2"])
@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_generate_with_an_image_gives_plain_transformers_tokens(ranks2, checkpoints, arch, layout):
    assert ranks2.run(vlm_generate, checkpoints[arch], layout) == [True, True]


@pytest.mark.distributed
def test_the_current_key_layout_loads_too(ranks4, tmp_path):
    """A checkpoint stored under the model's own module names (``model.language_model.*``), not the older layout
    ``save_pretrained`` writes, loads to the same parity."""
    from safetensors.torch import save_file

    model = build_vlm(tiny_vlm_config("llava"))
    model.config.save_pretrained(tmp_path)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert any(name.startswith("model.language_model.") for name in state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _assert_parity(ranks4.run(vlm_parity, str(tmp_path), {"strategy": "fsdp2", "tp_size": 2}), {})


@pytest.mark.distributed
def test_context_parallelism_is_refused_with_the_reason(ranks2):
    import re

    for error in ranks2.run(vlm_refusal, {}, "qwen3_vl", {"strategy": "fsdp2", "cp_size": 2}):
        assert re.search("context parallelism .cp_size=2. splits the token sequence", error), error
        assert "encoder tower beside its language decoder" in error, error


@pytest.mark.distributed
def test_a_language_model_whose_heads_do_not_divide_tp_is_refused(ranks2):
    """The plan's head check reads the language model's config, not the vision tower's."""
    text = dict(VLM_ARCHITECTURES["gemma3"][1]["text_config"], num_attention_heads=1, num_key_value_heads=1)
    for error in ranks2.run(vlm_refusal, {"text_config": text}, "gemma3", {"strategy": "fsdp2", "tp_size": 2}):
        assert "num_attention_heads=1 is not divisible by tp_size=2" in error, error


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny Llama sequence classifier (3 labels, padding token 0), saved in shards."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.tiny_models import tiny_config

    directory = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    config = tiny_config("llama", num_labels=3, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory, max_shard_size="40KB")
    return str(directory)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "layout"),
    [(4, {"strategy": "fsdp2"}), (2, {"strategy": "fsdp2", "tp_size": 2}), (4, {"strategy": "fsdp2", "tp_size": 2})],
    ids=["fsdp2_dp4", "tp2", "fsdp2_tp_2x2"],
)
def test_sequence_classifier_matches_plain_transformers(request, classifier, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    for rank, result in enumerate(pool.run(sequence_classification_parity, classifier, layout)):
        assert result["on_meta"] == [] and result["buffers"] == 0.0, result
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
        assert result["score_is_dtensor"], "the head is a parameter of the parallelized model's mesh"


@pytest.mark.distributed
def test_from_config_gives_the_weights_of_the_same_seed(ranks4):
    from tests.cases.vlm import vlm_from_config_matches_seed

    for result in ranks4.run(vlm_from_config_matches_seed, "qwen3_vl", {"strategy": "fsdp2", "tp_size": 2}, 7):
        assert result["weights"] == 0.0 and result["count"] == result["reference"], result


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize(
    "layout", [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "tp_size": 2}], ids=["fsdp2_dp4", "fsdp2_tp_2x2"]
)
def test_lora_on_both_towers_matches_peft(ranks4, checkpoints, arch, layout):
    from tests.cases.vlm import vlm_lora_parity

    for rank, result in enumerate(ranks4.run(vlm_lora_parity, checkpoints[arch], layout)):
        # Vision adapters: CLIP's q_proj and v_proj in 2 blocks; Qwen2.5-VL's fused qkv is no target, its down_proj is.
        assert result["vision_adapters"] == {"llava": 4, "qwen2_5_vl": 2}[arch], result
        assert result["trainable"] == result["ref_trainable"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"


@pytest.mark.distributed
def test_a_plan_that_names_the_score_head_shards_it(ranks2, classifier):
    """The head follows the plan where the plan names it (here the output features of ``score`` over ``tp``)."""
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(classifier).base_model_tp_plan
    plan = {f"model.{rule}": style for rule, style in base.items()} | {"score": "colwise_gather_output"}
    layout = {"strategy": "fsdp2", "tp_size": 2}
    for rank, result in enumerate(ranks2.run(sequence_classification_parity, classifier, layout, plan)):
        assert result["score_placements"] == ["S(0)"], result
        assert result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
