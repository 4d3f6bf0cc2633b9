"""``train.loss: chunked``: the head and the cross-entropy over token chunks give the loss and every gradient of the
model's own loss (packed batches, uneven chunks) under FSDP2, HSDP, TP (vocabulary-sharded head), SP, CP, FSDP2 x
TP, EP and DDP; unsupported models and options are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.training.config import ConfigError, load_config
from automodel.training.loss import ChunkedCrossEntropy, ModelLoss, check_chunked_loss_support, make_loss
from tests.cases.loss import chunked_loss_parity
from tests.tiny_models import VOCAB, build_model, tiny_config, token_batch

TOLERANCE = 1e-5

LAYOUTS = [
    ("llama", 4, {"strategy": "fsdp2"}),
    ("llama_tied", 2, {"strategy": "fsdp2"}),
    ("llama_tied", 4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    ("llama", 2, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama_tied", 2, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama", 2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
    ("llama", 2, {"strategy": "fsdp2", "cp_size": 2}),
    ("llama", 4, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama", 4, {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2}),
    ("mixtral", 4, {"strategy": "fsdp2", "ep_size": 2}),
    ("llama", 2, {"strategy": "ddp"}),
]
IDS = [
    "fsdp2_dp4",
    "tied-fsdp2_dp2",
    "tied-hsdp_2x2",
    "tp2",
    "tied-tp2",
    "tp2_sp",
    "cp2",
    "fsdp2_tp_2x2",
    "cp2_x_tp2",
    "mixtral-ep2",
    "ddp2",
]


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "world", "layout"), LAYOUTS, ids=IDS)
def test_chunked_loss_equals_the_model_loss(request, arch, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    for rank, result in enumerate(pool.run(chunked_loss_parity, layout, arch)):
        assert result["loss_difference"] <= TOLERANCE and result["grad"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["head_grad_norm"] > 0, result
        assert result["logits_shape"] == (*result["input_shape"], VOCAB), result
        if layout.get("tp_size", 1) > 1:
            assert "Shard(dim=0)" in result["head_placements"], f"the head's vocabulary is not TP-sharded: {result}"


def test_chunk_size_does_not_change_the_result():
    config = tiny_config("llama")
    batch = token_batch(4, 16)
    inputs = {"input_ids": batch, "labels": batch}
    count = torch.tensor(float(4 * 15))
    model = build_model(config)
    reference = ModelLoss()(model, inputs, count)
    for chunk in (1, 7, 60, 10_000):
        loss = ChunkedCrossEntropy(chunk)(model, inputs, count)
        assert (loss - reference).abs().item() <= TOLERANCE, chunk
    # Without a token count it is the mean over the valid tokens, as the model's own loss.
    mean = ChunkedCrossEntropy(8)(model, inputs, None)
    assert (mean - model(**inputs).loss).abs().item() <= TOLERANCE


def test_without_gradients_it_computes_only_the_loss():
    model = build_model(tiny_config("llama"))
    batch = token_batch(2, 8)
    with torch.no_grad():
        loss = ChunkedCrossEntropy(4)(model, {"input_ids": batch, "labels": batch}, None)
    assert not loss.requires_grad and (loss - model(input_ids=batch, labels=batch).loss).abs() <= TOLERANCE


def test_a_model_that_transforms_its_logits_is_refused():
    config = tiny_config("gemma3", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0.*Use train.loss=model"):
        check_chunked_loss_support(AutoModelForCausalLM.from_config(config))
    config = tiny_config("mixtral", output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        check_chunked_loss_support(AutoModelForCausalLM.from_config(config))


def test_config_keys(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("recipe: pretrain\nmodel: {path: m}\ndata: {path: d}\n")
    default = load_config(path)
    assert default.train.loss == "model" and isinstance(make_loss("model", 1024), ModelLoss)
    chunked = load_config(path, ["train.loss=chunked", "train.loss_chunk_size=2048"])
    assert make_loss(chunked.train.loss, chunked.train.loss_chunk_size) == ChunkedCrossEntropy(2048)
    with pytest.raises(ConfigError, match="train.loss='fused' is not one of"):
        load_config(path, ["train.loss=fused"])
    with pytest.raises(ConfigError, match="train.loss_chunk_size=0 must be at least 1"):
        load_config(path, ["train.loss_chunk_size=0"])
    with pytest.raises(ConfigError, match="train.loss=chunked runs with layout.strategy=fsdp2 or ddp"):
        load_config(path, ["train.loss=chunked", "layout.strategy=megatron_fsdp"])


@pytest.mark.distributed
def test_the_recipe_trains_the_same_with_the_chunked_loss(ranks2, tmp_path):
    """SFT on packed chat data, FSDP2 over 2 ranks: ``train.loss=chunked`` follows the model loss step by step."""
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint, train

    checkpoint = save_tiny_chat_checkpoint(tmp_path / "tiny_chat")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}, packing: true}}
train: {{max_steps: 4, global_batch_size: 4, micro_batch_size: 1, seq_len: 96, lr: 3.0e-3}}
"""
    )
    plain = ranks2.run(train, str(config), [])[0]["losses"]
    chunked = ranks2.run(train, str(config), ["train.loss=chunked", "train.loss_chunk_size=16"])[0]["losses"]
    assert abs(plain[0] - chunked[0]) <= TOLERANCE, (plain, chunked)
    # Later steps start from weights updated with gradients equal to ~1e-8: the losses stay within 1e-4.
    assert max(abs(a - b) for a, b in zip(plain, chunked, strict=True)) <= 1e-4, (plain, chunked)
