"""Activation checkpointing that keeps module names (and so checkpoint keys and plans) unchanged.

``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every parameter name; instead the module's
bound ``forward`` is wrapped in ``torch.utils.checkpoint.checkpoint`` in place. Hooks (TP transforms, FSDP
unshard/reshard) stay outside the checkpointed region, as with the wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .model_structure import decoder_layers

__all__ = ["apply_activation_checkpointing", "checkpoint_module", "selective_checkpoint_policy"]

_aten = torch.ops.aten
# Saved under "selective": the matmul outputs (expensive to recompute) and routing decisions (top-k can pick other
# experts when recomputed on GPU). Everything else (norms, activations, elementwise) is recomputed.
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.topk.default,
}


# transformers' names for the KV cache argument of layers and attention modules.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def selective_checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul, attention and top-k outputs; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, *, selective: bool = False) -> nn.Module:
    """Recompute ``module``'s forward during backward (``selective``: only what the policy does not save)."""
    inner = module.forward
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy) if selective else None
    )

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        # The backward replay would write the KV cache a second time (as transformers' own checkpointing layer
        # knows): a checkpointed module runs without one.
        for name in _CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    module.forward = forward
    module._automodel_checkpointed = True
    return module


def _layer_blocks(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's composite children (attention, MLP, MoE ...): those that contain other modules."""
    return [child for child in layer.children() if next(child.children(), None) is not None]


def apply_activation_checkpointing(
    model: nn.Module,
    mode: str,
    *,
    full_layers: bool,
    blocks: Callable[[nn.Module], list[nn.Module]] = _layer_blocks,
) -> list[nn.Module]:
    """Checkpoint each decoder layer's blocks (attention, MLP) or, with ``full_layers``, whole decoder layers.

    ``mode`` is ``"full"`` (recompute the whole block) or ``"selective"`` (op-level: see
    :func:`selective_checkpoint_policy`). Returns the checkpointed modules.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not 'full' or 'selective'.")
    targets: list[nn.Module] = []
    for layer in decoder_layers(model):
        targets.extend([layer] if full_layers else blocks(layer))
    for module in targets:
        checkpoint_module(module, selective=mode == "selective")
    return targets
