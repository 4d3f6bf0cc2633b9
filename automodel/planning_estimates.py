"""The figures of a simulated rank that are computed rather than read off the model: FSDP2's padded shard and
all-gather sizes (with the parameters it does not manage), and the activation estimate (``docs/plan.md``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from automodel._compat.torch import fsdp_sizes
from automodel.distributed import MeshContext
from automodel.loading.initialization import local_view

__all__ = ["activation_estimate", "fsdp_sizes_with_unmanaged"]


def fsdp_sizes_with_unmanaged(model: nn.Module, params: list[nn.Parameter]) -> tuple[int, int]:
    """(bytes FSDP2 allocates for this rank's shards, padding included, plus the parameters it does not manage;
    the largest unit's all-gather output in bytes)."""
    padded, largest = fsdp_sizes(model)
    unmanaged = sum(local_view(p).numel() * p.element_size() for p in params if id(p) not in padded)
    return sum(padded.values()) + unmanaged, largest


def activation_estimate(
    context: MeshContext,
    config: PretrainedConfig,
    micro_batch_size: int | None,
    seq_len: int | None,
    dtype: torch.dtype,
    stages: Any = None,
) -> int | None:
    """Activation bytes kept for backward by one micro batch (``docs/plan.md``: the formula and what it leaves out);
    under PP, by the microbatches in flight on this rank, over its stages' layers (the logits on the last stage's
    rank: one microbatch's, or every microbatch's under GPipe, which runs all forwards first).

    Per token of this rank's sequence (``seq_len / cp``) and per layer, in the compute dtype: about ``10 H`` for
    attention (norm, q / k / v inputs and outputs, scores' output, output projection) and ``4 I`` for the MLP (gate,
    up, activation, product), with ``I`` the active experts' width for a MoE; TP divides the ``I`` terms and, with
    sequence parallelism, the ``H`` terms. Full activation checkpointing keeps each layer's input (``H``) plus one
    layer's activations during its recomputation; selective keeps the matmul outputs (about half). The logits of the
    micro batch are added in fp32 (``V / tp`` per token).
    """
    if micro_batch_size is None or seq_len is None:
        return None
    text = config.get_text_config()
    hidden = text.hidden_size
    layers = text.num_hidden_layers
    width = _mlp_width(text)
    tp, cp = context.tp_size, context.cp_size
    compute = getattr(context.strategy, "param_dtype", None) or dtype  # FSDP2 mixed precision computes in param_dtype
    element = torch.tensor([], dtype=compute).element_size()
    tokens = micro_batch_size * -(-seq_len // cp)
    hidden_terms = 10 * hidden / (tp if context.sequence_parallel else 1)
    per_layer = tokens * element * (hidden_terms + 4 * width / tp)
    mode = context.activation_checkpointing
    in_flight, logits_kept = 1.0, 1
    if stages is not None:
        layout = context.pipeline
        layers, in_flight = stages.local_layers(context), layout.in_flight()
        logits_kept = 0
        if layout.num_stages - 1 in layout.local_stages:
            logits_kept = layout.microbatches if layout.schedule == "gpipe" else 1
    if mode == "full":
        kept = in_flight * layers * tokens * element * hidden + per_layer
    elif mode == "selective":
        kept = in_flight * layers * per_layer / 2
    else:
        kept = in_flight * layers * per_layer
    logits = logits_kept * tokens * 4 * text.vocab_size / tp
    return int(kept + logits)


def _mlp_width(text: PretrainedConfig) -> int:
    experts_per_token = getattr(text, "num_experts_per_tok", None)
    moe_width = getattr(text, "moe_intermediate_size", None)
    if experts_per_token and moe_width:
        shared = getattr(text, "n_shared_experts", 0) or 0
        return (experts_per_token + shared) * moe_width
    return getattr(text, "intermediate_size", None) or 4 * text.hidden_size
