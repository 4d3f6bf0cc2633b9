"""Context parallelism on CPU ranks: the same logits, loss and gradients as one plain process (CP=1), within 1e-4."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoConfig, PretrainedConfig

from tests.cases.context_parallel import cp_error, cp_parity
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {"strategy": "fsdp2", "cp_size": 2}), (4, {"strategy": "fsdp2", "cp_size": 2})],
    ids=["cp2", "cp2_x_dp_shard2"],
)
def test_context_parallel_matches_one_process(request, world, layout, architecture):
    pool = request.getfixturevalue(f"ranks{world}")
    for result in pool.run(cp_parity, layout, architecture, 16):
        assert result["local_len"] == 8
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


@pytest.mark.parametrize(
    "layout",
    [
        {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2},
        {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2, "sequence_parallel": True},
        {"strategy": "fsdp2", "cp_size": 2, "dp_replicate_size": 2, "activation_checkpointing": "selective"},
    ],
    ids=["cp2_x_tp2", "cp2_x_tp2_sp", "hsdp2_x_cp2_selective_ac"],
)
def test_context_parallel_composes_with_tp_sp_hsdp_and_ac(ranks4, layout):
    for result in ranks4.run(cp_parity, layout, "qwen3", 16):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


def _config(model_type: str, attention: str = "sdpa", **values: Any) -> PretrainedConfig:
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    config = AutoConfig.for_model(model_type, num_attention_heads=4, num_key_value_heads=2, **small, **values)
    config._attn_implementation = attention
    return config


ATTENTIONS = {
    # Gemma-2's logit soft-capping inside attention (transformers runs it in its eager attention), with no sliding
    # layers (those are refused).
    "soft_capped": (
        "gemma2",
        {"layer_types": ["full_attention"] * 2, "attn_logit_softcapping": 0.02, "attention": "eager"},
    ),
    # Gemma's bidirectional attention is the attention module's is_causal=False, which transformers' SDPA path honours
    # (its eager path masks causally all the same).
    "bidirectional": ("gemma", {"use_bidirectional_attention": True}),
    "bidirectional_gemma3": (
        "gemma3_text",
        {"use_bidirectional_attention": True, "layer_types": ["full_attention"] * 2},
    ),
}


def _attention_cases():
    for attention in ATTENTIONS:
        for left_padded in (False, True):
            # transformers' Gemma (v1) masks causally whenever a padding mask is given (its mask builder is the
            # causal one; only SDPA without a mask sees is_causal=False): no one answer to keep there.
            if not (attention == "bidirectional" and left_padded):
                yield pytest.param(
                    attention, left_padded, id=f"{attention}-{'left_padded' if left_padded else 'unpadded'}"
                )


@pytest.mark.parametrize(("attention", "left_padded"), _attention_cases())
def test_soft_capped_and_bidirectional_attention_and_padding_match_one_process(ranks2, attention, left_padded):
    """The CP kernel keeps what the model's own attention does: its soft-capping, its bidirectional mask, and a
    padding mask (left padding: the real tokens never see the pads)."""
    model_type, values = ATTENTIONS[attention]
    layout = {"strategy": "fsdp2", "cp_size": 2}
    for result in ranks2.run(cp_parity, layout, _config(model_type, **values), 16, left_padded=left_padded):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


def test_a_left_padded_batch_matches_one_process_under_cp_and_tp(ranks4):
    layout = {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2}
    for result in ranks4.run(cp_parity, layout, "llama", 16, left_padded=True):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


def test_sequence_not_a_multiple_of_two_cp_is_a_clear_error(ranks2):
    message = ranks2.run(cp_error, {"strategy": "fsdp2", "cp_size": 2}, "llama", 10)[0]
    assert "2 * cp_size = 4 chunks" in message and "length 10" in message


def test_sliding_window_blocks_are_refused_by_name(ranks2):
    message = ranks2.run(cp_error, {"strategy": "fsdp2", "cp_size": 2}, "mistral", None, sliding_window=4)[0]
    assert "decoder layer 0 (MistralDecoderLayer)" in message and "sliding window" in message
