"""Gemma 3n's TP plan: the MLPs of layers with activation sparsity keep their intermediate dimension whole.

A layer with ``activation_sparsity_pattern[i] > 0`` keeps the gate activations above ``mean + k * std`` of each
token's gate vector, statistics over the intermediate dimension. transformers' plan shards that dimension (gate / up
colwise, down rowwise), so each rank would compute the cutoff from its own half of the features. Those layers' MLPs
stay replicated; the other layers' MLPs and all the attention follow transformers' plan.
"""

from __future__ import annotations

from torch import nn

from automodel.distributed import ModelParallelizer

__all__ = ["PARALLELIZER"]

_MLP_RULE = ".layers.*.mlp."


def _plan_with_dense_mlps_only(model: nn.Module) -> dict[str, str]:
    sparsity = model.config.get_text_config().activation_sparsity_pattern
    plan = {}
    for rule, style in model.tp_plan.items():
        if _MLP_RULE not in rule:
            plan[rule] = style
            continue
        # The rule for every layer becomes one rule per layer without sparsity (exact names win over wildcards).
        for index, level in enumerate(sparsity):
            if not level:
                plan[rule.replace(".*.", f".{index}.", 1)] = style
    return plan


class Gemma3nParallelizer(ModelParallelizer):
    """transformers' Gemma 3n plan with the MLPs of activation-sparse layers left replicated."""

    _tp_plan = staticmethod(_plan_with_dense_mlps_only)


PARALLELIZER = Gemma3nParallelizer()
