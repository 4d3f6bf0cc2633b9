"""The figures of a simulated rank that are computed rather than read off the model: FSDP2's padded shard and
all-gather sizes (with the parameters it does not manage), and the activation estimate (``docs/plan.md``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from automodel._compat.torch import fsdp_sizes
from automodel.activation_estimate import activation_bytes
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
    """Activation bytes kept for backward by one micro batch (:func:`automodel.activation_estimate.activation_bytes`;
    ``docs/plan.md``), in the compute dtype (FSDP2's mixed-precision ``param_dtype``, else the load dtype); under PP,
    over the rank's stages' layers and its microbatches in flight, the logits on the last stage's rank (one
    microbatch's, or every microbatch's under GPipe, which runs all forwards first)."""
    if micro_batch_size is None or seq_len is None:
        return None
    compute = getattr(context.strategy, "param_dtype", None) or dtype
    layers, in_flight, logits_kept = None, 1.0, 1
    if stages is not None:
        layout = context.pipeline
        layers, in_flight = stages.local_layers(context), layout.in_flight()
        last = layout.num_stages - 1 in layout.local_stages
        logits_kept = (layout.microbatches if layout.schedule == "gpipe" else 1) if last else 0
    return activation_bytes(
        config.get_text_config(),
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        tp_size=context.tp_size,
        cp_size=context.cp_size,
        sequence_parallel=context.sequence_parallel,
        activation_checkpointing=context.activation_checkpointing,
        element_size=torch.tensor([], dtype=compute).element_size(),
        layers=layers,
        in_flight=in_flight,
        logits_kept=logits_kept,
    )
