"""Gemma 4's TP plan: with per-layer inputs, the (tied) token embedding and output head stay replicated.

When ``hidden_size_per_layer_input > 0``, ``Gemma4ForConditionalGeneration`` reads the pad token's row of
``language_model.embed_tokens.weight`` directly, outside the embedding's forward, where a TP style cannot turn the
vocabulary-sharded weight into its whole row. With that feature on, the embedding (and the head tied to it) keep
their whole vocabulary on every TP rank (FSDP still shards their storage); everything else follows transformers'
plan. Without it, transformers' plan applies unchanged.
"""

from __future__ import annotations

from torch import nn

from automodel.distributed import ModelParallelizer

__all__ = ["PARALLELIZER"]

_EMBEDDING = "embed_tokens"
_HEAD = "lm_head"


def _plan(model: nn.Module) -> dict[str, str]:
    plan = dict(model.tp_plan)
    if not model.config.get_text_config().hidden_size_per_layer_input:
        return plan
    return {rule: style for rule, style in plan.items() if not rule.endswith((_EMBEDDING, _HEAD))}


class Gemma4Parallelizer(ModelParallelizer):
    """transformers' Gemma 4 plan, with the tied embedding and head replicated when the model reads the embedding
    weight directly (per-layer inputs)."""

    _tp_plan = staticmethod(_plan)


PARALLELIZER = Gemma4Parallelizer()
