"""LoRA adapters (``peft``, an optional extra) added to a model on the meta device, before it is parallelized.

``NeMoAutoModelForCausalLM.from_pretrained(..., peft_config=LoraConfig(...))`` injects the adapters with peft's own
``inject_adapter_in_model`` while the model is still on the meta device, freezes everything else, and lets the
parallelizer shard base weights and adapters alike (FSDP2 puts frozen and trainable parameters in the same units).
The loader reads the base weights from the checkpoint under their original names and fills the adapters with peft's
default init (Kaiming-uniform ``lora_A``, zero ``lora_B``) computed once, identically on every rank.
``merge_lora`` folds trained adapters back into the base weights for an export plain transformers loads.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import nn

from automodel.distributed import FSDP2Config, MeshContext
from automodel.distributed.runtime import full_tensor
from automodel.loading.initialization import local_view
from automodel.loading.placements import local_indices
from automodel.loading.sources import InMemoryTensor, Source, select

__all__ = ["add_lora", "merge_lora", "require_peft"]

_BASE_LAYER = ".base_layer."


def require_peft() -> Any:
    """Import ``peft``, or say how to install it."""
    try:
        return importlib.import_module("peft")
    except ImportError as error:
        raise ImportError('LoRA needs the peft package: pip install "automodel[peft]".') from error


def _check_layout(peft_config: Any, mesh_context: MeshContext | None) -> None:
    peft = require_peft()
    if not isinstance(peft_config, peft.LoraConfig):
        raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}.")
    if peft_config.init_lora_weights is not True:
        raise ValueError(
            f"peft_config.init_lora_weights={peft_config.init_lora_weights!r}: the sharded loader initialises "
            "adapters with peft's default (True: Kaiming-uniform lora_A, zero lora_B) only."
        )
    if mesh_context is None:
        return
    if not isinstance(mesh_context.strategy, FSDP2Config):
        raise ValueError(f"LoRA runs on the FSDP2 path: use strategy='fsdp2', not {mesh_context.strategy.name!r}.")
    if mesh_context.tp_size > 1 or mesh_context.ep_size > 1:
        raise ValueError(
            f"LoRA with tp_size={mesh_context.tp_size}, ep_size={mesh_context.ep_size}: the adapters wrap the projections "
            "that TP / EP plans name, so they cannot be combined yet. Use FSDP2 (with HSDP / CP) and tp_size = "
            "ep_size = 1."
        )


def add_lora(
    model: nn.Module, peft_config: Any, mesh_context: MeshContext | None, sources: dict[str, Source], *, seed: int = 0
) -> dict[str, Source]:
    """Inject LoRA adapters into ``model`` (on the meta device), freeze everything else, and return the checkpoint
    ``sources`` renamed for the wrapped layers plus initial values for every adapter parameter."""
    _check_layout(peft_config, mesh_context)
    peft = require_peft()
    with torch.device("meta"):
        peft.inject_adapter_in_model(peft_config, model)
    renamed = dict(sources)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name
        if _BASE_LAYER in name:
            original = name.replace(_BASE_LAYER, ".")
            if original in renamed:
                renamed[name] = renamed.pop(original)
        elif ".lora_A." in name:
            full = torch.empty(param.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)  # peft's default
            renamed[name] = InMemoryTensor(full.to(param.dtype))
        elif ".lora_B." in name:
            renamed[name] = InMemoryTensor(torch.zeros(param.shape, dtype=param.dtype))
    return renamed


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its (possibly sharded) base weight and put the base layer back in its place, so
    the model has transformers' own module tree and parameter names again (for an export). Collective: every rank
    calls it."""
    lora = require_peft().tuners.lora
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, lora.LoraLayer)]
    for name, module in layers:
        base = module.base_layer
        for adapter in module.active_adapters:
            delta = (
                full_tensor(module.lora_B[adapter].weight).float() @ full_tensor(module.lora_A[adapter].weight).float()
            )
            delta = delta * module.scaling[adapter]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            local = local_view(base.weight)
            local.add_(select(delta, local_indices(base.weight)).to(local.dtype))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
    return model
