"""Activation checkpointing that keeps module names (and so checkpoint keys and plans) unchanged.

``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every parameter name; instead the module's
bound ``forward`` is wrapped in ``torch.utils.checkpoint.checkpoint`` in place. Hooks (TP transforms, FSDP
unshard/reshard) stay outside the checkpointed region, as with the wrapper.

MoE routing decisions are saved, not recomputed, in both modes: every top-k a checkpointed block runs in forward is
recorded, and the backward replay gets the recorded result instead of computing it again (a recomputed top-k can
route differently on GPU, and then the replayed experts see other tokens than the forward did).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from automodel._compat.torch import SDPA_KERNEL_OPS, TorchDispatchMode, tree_map_only
from automodel._compat.transformers import CACHE_ARGUMENTS

from .model_structure import decoder_layers

__all__ = [
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpoint_targets",
    "selective_checkpoint_policy",
]

_aten = torch.ops.aten
# Saved under "selective": the matmul outputs (expensive to recompute). Everything else (norms, activations,
# elementwise) is recomputed, except the routing top-k, which both modes replay (`_routing_contexts`). Top-k is not
# a SAC "save" op: routers normalise its output in place, which SAC's cache refuses.
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    *SDPA_KERNEL_OPS,
}
# The ops that make routing decisions (transformers' MoE routers all select experts with top-k).
_ROUTING_OPS = {_aten.topk.default}


def selective_checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul and attention outputs; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _RecordRouting(TorchDispatchMode):
    """Forward side: keep a copy of every routing op's result (copied before the router edits it in place)."""

    def __init__(self, decisions: list[Any]) -> None:
        super().__init__()
        self.decisions = decisions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ROUTING_OPS:
            self.decisions.append(tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out))
        return out


class _ReplayRouting(TorchDispatchMode):
    """Recompute side: hand back the recorded routing results, in order, instead of computing them again.

    Autograd sits above this mode, so the replayed top-k still gets its backward node (scattering into the
    recomputed router logits).
    """

    def __init__(self, decisions: list[Any]) -> None:
        super().__init__()
        self.decisions = decisions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _ROUTING_OPS:
            return func(*args, **(kwargs or {}))
        if not self.decisions:
            raise RuntimeError(
                "The backward recomputation of a checkpointed block ran more routing top-k ops than its forward did."
            )
        return self.decisions.pop(0)


@contextlib.contextmanager
def _nested(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _routing_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint`` contexts (forward, recompute) that record and replay routing decisions."""
    decisions: list[Any] = []
    return _RecordRouting(decisions), _ReplayRouting(decisions)


def _selective_contexts(
    replay_routing: bool,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Torch's selective-checkpoint contexts for ``selective_checkpoint_policy``, plus the routing replay."""
    save_forward, save_recompute = create_selective_checkpoint_contexts(selective_checkpoint_policy)
    if not replay_routing:
        return save_forward, save_recompute
    record, replay = _routing_contexts()
    return _nested(save_forward, record), _nested(save_recompute, replay)


def _compiled_contexts(selective: bool, replay_routing: bool) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of a checkpoint inside a compiled block: torch.compile takes only selective-checkpoint
    contexts, so both modes become a policy there ("full": save nothing but the routing top-k; "selective": the matmuls
    too). A compiled graph is functional, so saving the top-k no longer conflicts with the router's in-place
    normalisation, and the recomputation gets the saved routing decisions as in eager mode."""
    saved = (_SAVED_OPS if selective else set()) | (_ROUTING_OPS if replay_routing else set())
    if not saved:
        return noop_context_fn

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def checkpoint_module(module: nn.Module, *, selective: bool = False, replay_routing: bool = True) -> nn.Module:
    """Recompute ``module``'s forward during backward (``selective``: only what the policy does not save).

    With ``replay_routing`` routing decisions (top-k) are recorded in forward and replayed in the recomputation.
    """
    # The checkpointed function is looked up on every call, so that a step after this one can still wrap what runs
    # inside the checkpoint (and so in its recomputation): TP's local-replica swap, installed after a sidecar's early
    # checkpointing, must run in the recomputation too.
    module._automodel_checkpointed_forward = module.forward
    if selective:
        context_fn = functools.partial(_selective_contexts, replay_routing)
    else:
        context_fn = _routing_contexts if replay_routing else noop_context_fn

    @functools.wraps(module.forward)
    def forward(*args, **kwargs):
        inner = module._automodel_checkpointed_forward
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        # The backward replay would write the KV cache a second time (as transformers' own checkpointing layer
        # knows): a checkpointed module runs without one.
        for name in CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        contexts = _compiled_contexts(selective, replay_routing) if torch.compiler.is_compiling() else context_fn
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)

    module.forward = forward
    module._automodel_checkpointed = True
    return module


def _layer_blocks(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's composite children (attention, MLP, MoE ...): those that contain other modules."""
    return [child for child in layer.children() if next(child.children(), None) is not None]


def checkpoint_targets(
    layers: list[nn.Module], *, full_layers: bool, blocks: Callable[[nn.Module], list[nn.Module]] = _layer_blocks
) -> list[nn.Module]:
    """The modules activation checkpointing wraps: each decoder layer's blocks (attention, MLP) or, with
    ``full_layers``, the whole layers."""
    targets: list[nn.Module] = []
    for layer in layers:
        targets.extend([layer] if full_layers else blocks(layer))
    return targets


def apply_activation_checkpointing(
    model: nn.Module,
    mode: str,
    *,
    full_layers: bool,
    blocks: Callable[[nn.Module], list[nn.Module]] = _layer_blocks,
    replay_routing: bool = True,
) -> list[nn.Module]:
    """Checkpoint each decoder layer's blocks (attention, MLP) or, with ``full_layers``, whole decoder layers.

    ``mode`` is ``"full"`` (recompute the whole block) or ``"selective"`` (op-level: see
    :func:`selective_checkpoint_policy`). Returns the checkpointed modules.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not 'full' or 'selective'.")
    targets = checkpoint_targets(decoder_layers(model), full_layers=full_layers, blocks=blocks)
    for module in targets:
        checkpoint_module(module, selective=mode == "selective", replay_routing=replay_routing)
    return targets
