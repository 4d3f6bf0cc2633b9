"""Tiny random models and batches shared by the tests (small enough for 4 CPU ranks on 2 cores)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

VOCAB = 96


def tiny_llama_config(**overrides) -> PretrainedConfig:
    """A 2-layer Llama with 4 query heads and 2 KV heads (TP=2 divides both)."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    values.update(overrides)
    return AutoConfig.for_model("llama", **values)


def build_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The plain transformers model for ``config`` with weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_batch(batch_size: int = 8, seq_len: int = 8, seed: int = 1) -> torch.Tensor:
    """Random token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
