"""Replicated parameters that compute on TP-sharded activations: their gradients are partial and are summed over TP.

A colwise projection hands each TP rank a slice of its output features. A module the plan leaves replicated that
computes on that slice (a learnable activation after ``up_proj``, per-head ``q_norm`` / ``k_norm`` after ``q_proj``)
gets on each rank the gradient of its own slice only; a correct plan marks it ``replicated_with_grad_allreduce``, and
many plans in transformers miss some (Apertus' XIELU scalars, Sarvam-MoE's q/k norms).

Which modules do is decided from the data flow, at the first forward with gradients, without names: the outputs of
sharded-output styles (and of every module computing on them) are recorded by storage, and a replicated module whose
input is one of them gets its parameters' gradients summed over TP from then on (rank 0 logs which); a module holding
a styled module passes no sharding on (the style it holds restores its output). A replicated ``nn.Linear`` whose
input has fewer features than it takes (a plan that shards ``up_proj`` but not ``down_proj``) is a wrong plan: it is
refused there, naming the module, instead of failing on a shape deep in the forward. A module whose
input is replicated (a norm before a colwise projection) is left alone. The detection hooks are removed after that
forward; they run eagerly in compiled blocks (``torch.compiler.disable``: storages cannot be traced), so the first
forward of a compiled model breaks its graphs where they sit, and the blocks are compiled again without them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from automodel._compat.torch import tree_leaves

from .runtime import log_rank_zero
from .tp_styles import REPLICATED_WITH_GRAD_ALLREDUCE_ONCE, TensorParallelLayer, is_replicated, shards_output

__all__ = ["reduce_partial_gradients"]

logger = logging.getLogger(__name__)


def reduce_partial_gradients(model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, TensorParallelLayer]) -> None:
    """Arm the first-forward detection on ``model`` (TP applied with ``styles``, by module or parameter name)."""
    modules = dict(model.named_modules())
    # Modules with a style of their own, or whose parameters the plan places: TP decides their layouts.
    styled = {name if name in modules else name.rpartition(".")[0] for name in styles}
    producers = [modules[name] for name, style in styles.items() if name in modules and shards_output(style)]
    if not producers:
        return
    detection = _Detection(tp_mesh)
    handles = [producer.register_forward_hook(detection.record_outputs) for producer in producers]
    # The modules holding a styled one, by name: every proper dotted prefix of a styled name (a set, not a scan of
    # the styled names per module: 80 layers under TP made that 0.5 million string compares).
    holders = {name.rsplit(".", depth)[0] for name in styled if name for depth in range(1, name.count(".") + 1)}
    for name, module in modules.items():
        if name in styled or module is model or _inside_styled(name, styled):
            continue
        handles.append(module.register_forward_pre_hook(detection.check_inputs(name), with_kwargs=True))
        # A module holding a styled one (BERT's ``output`` around the rowwise ``dense``, taking the sharded
        # intermediate activation) returns what that style restored: its outputs are not sharded features.
        if name not in holders:
            handles.append(module.register_forward_hook(detection.propagate))
    handles.append(model.register_forward_hook(detection.finish(handles, type(model).__name__)))


def _inside_styled(name: str, styled: set[str]) -> bool:
    """Whether a proper dotted prefix of ``name`` is styled (the module lies inside a styled one)."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in styled for end in range(1, len(parts)))


class _Detection:
    """The state of one model's first-forward detection."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh
        self.sharded: set[int] = set()  # storages of tensors holding a slice of the features
        # ... kept alive until the forward ends, so that no other tensor reuses one of those storages meanwhile.
        self.alive: list[torch.Tensor] = []
        self.consumers: dict[nn.Module, bool] = {}  # module -> whether its input was sharded in this call
        self.reduced: list[str] = []

    @torch.compiler.disable
    def record_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._record(output)

    def _record(self, output: Any) -> None:
        tensors = _plain_tensors(output)
        self.alive.extend(tensors)
        self.sharded.update(tensor.untyped_storage().data_ptr() for tensor in tensors)

    def check_inputs(self, name: str) -> Callable[..., None]:
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            inputs = _plain_tensors((args, kwargs))
            on_shards = any(tensor.untyped_storage().data_ptr() in self.sharded for tensor in inputs)
            self.consumers[module] = on_shards
            if isinstance(module, nn.Linear) and inputs and inputs[0].shape[-1] != module.in_features:
                raise ValueError(
                    f"{name} ({type(module).__name__}, {module.in_features} input features) is left replicated by the "
                    f"TP plan, but its input has {inputs[0].shape[-1]} features on this rank: a slice that a module "
                    "the plan shards column-wise hands it. Give it the 'rowwise' style, or do not shard the modules "
                    "before it (or use tp_size=1)."
                )
            if on_shards and _owns_replicated_trainable(module) and name not in self.reduced:
                self.reduced.append(name)
                # This call's parameters get the hook now; later ones (FSDP's re-registered, loaded) in forward.
                REPLICATED_WITH_GRAD_ALLREDUCE_ONCE.hook_parameters(module, self.tp_mesh)
                REPLICATED_WITH_GRAD_ALLREDUCE_ONCE.install_forward(module, self.tp_mesh)

        return hook

    @torch.compiler.disable
    def propagate(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module computing on sharded features produces sharded features (an activation, a norm, a reshape)."""
        if torch.is_grad_enabled() and self.consumers.pop(module, False):
            self._record(output)

    def finish(self, handles: list[Any], model_name: str) -> Callable[..., None]:
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for handle in handles:
                handle.remove()
            self.sharded.clear()
            self.alive.clear()
            if self.reduced:
                log_rank_zero(
                    logger,
                    "%s: modules the TP plan leaves replicated compute on sharded features, so their gradients are "
                    "summed over TP (a plan entry 'replicated_with_grad_allreduce' says the same): %s",
                    model_name,
                    self.reduced,
                )

        return hook


def _plain_tensors(tree: Any) -> list[torch.Tensor]:
    return [
        leaf
        for leaf in tree_leaves(tree)
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.numel()
    ]


def _owns_replicated_trainable(module: nn.Module) -> bool:
    return any(
        param.requires_grad and (is_replicated(param) or not isinstance(param, DTensor))
        for param in module.parameters(recurse=False)
    )
