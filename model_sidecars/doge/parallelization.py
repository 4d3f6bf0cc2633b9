"""Doge's TP plan: transformers' plan without its attention rules, which cannot shard Doge's attention correctly.

transformers' plan shards q/k/v by head (colwise) and makes ``dt_proj`` rowwise. But ``dt_proj`` maps the values of
all KV heads to one dt per KV head: rowwise all-reduces it, so every rank gets the dt of every head while it holds the
values of its own heads only (a shape error in the dynamic mask). The per-KV-head ``A`` would need the same head split,
and no transformers style reduce-scatters an output onto the head dimension. So the attention stays replicated over TP
(FSDP still shards its storage) and the MLP / CDMoE rules of transformers' plan apply as they are.
"""

from __future__ import annotations

from torch import nn

from automodel.distributed import ModelParallelizer

__all__ = ["PARALLELIZER"]

_ATTENTION = ".self_attn."


def _plan_without_attention(model: nn.Module) -> dict[str, str]:
    return {rule: style for rule, style in model.tp_plan.items() if _ATTENTION not in f"{rule}."}


class DogeParallelizer(ModelParallelizer):
    """transformers' Doge plan minus the attention rules (the attention stays replicated over TP)."""

    _tp_plan = staticmethod(_plan_without_attention)


PARALLELIZER = DogeParallelizer()
