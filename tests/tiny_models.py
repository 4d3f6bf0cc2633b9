"""Tiny random models and batches shared by the tests (small enough for 4 CPU ranks on 2 cores)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

VOCAB = 96


def tiny_llama_config(**overrides) -> PretrainedConfig:
    """A 2-layer Llama with 4 query heads and 2 KV heads (TP=2 divides both), untied."""
    return tiny_config("llama", **overrides)


def build_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The plain transformers model for ``config`` with weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_batch(batch_size: int = 8, seq_len: int = 8, seed: int = 1) -> torch.Tensor:
    """Random token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)


_DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

# Tiny configs of every architecture the loader is tested on: heads and KV heads divide TP=2, experts divide 2.
ARCHITECTURES: dict[str, dict] = {
    "llama": dict(model_type="llama", **_DENSE, tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", **_DENSE, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", **_DENSE, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", **_DENSE, head_dim=8, tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", **_DENSE, tie_word_embeddings=False),
    "gemma3": dict(model_type="gemma3_text", **_DENSE, head_dim=8, sliding_window=4, query_pre_attn_scalar=8),
    "phi3": dict(model_type="phi3", **_DENSE, pad_token_id=0, tie_word_embeddings=False),
    # GPT-NeoX has no grouped-query attention.
    "gpt_neox": dict(
        model_type="gpt_neox",
        **{k: v for k, v in _DENSE.items() if k != "num_key_value_heads"},
        tie_word_embeddings=False,
    ),
    # Sizes that do not divide 4 ranks (vocabulary 97, MLP width 70): uneven shards everywhere.
    "llama_uneven": dict(model_type="llama", **{**_DENSE, "vocab_size": 97, "intermediate_size": 70}),
    "mixtral": dict(model_type="mixtral", **_DENSE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        **_DENSE,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    # gpt-oss: MXFP4 needs the experts' input dims to be multiples of 32.
    "gpt_oss": dict(
        model_type="gpt_oss",
        **{**_DENSE, "hidden_size": 64, "intermediate_size": 64},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        tie_word_embeddings=False,
        attn_implementation="eager",  # its attention sinks have no SDPA path
    ),
    "olmoe": dict(model_type="olmoe", **_DENSE, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


def tiny_config(architecture: str, **overrides) -> PretrainedConfig:
    """The tiny config of one tested architecture (``ARCHITECTURES``), with ``overrides``."""
    values = {**ARCHITECTURES[architecture], **overrides}
    model_type = values.pop("model_type")
    values.setdefault("attn_implementation", "sdpa")
    return AutoConfig.for_model(model_type, **values)


def save_tiny_checkpoint(architecture: str, directory, *, seed: int = 0, max_shard_size: str = "40KB", **overrides):
    """Save a tiny random checkpoint of ``architecture`` with ``save_pretrained`` (several shards) and return it."""
    model = build_model(tiny_config(architecture, **overrides), seed=seed)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory
