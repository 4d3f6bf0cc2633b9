"""LoRA adapters (``peft``, an optional extra) added to a model on the meta device, before it is parallelized.

``NeMoAutoModelForCausalLM.from_pretrained(..., peft_config=LoraConfig(...))`` injects the adapters with peft's own
``inject_adapter_in_model`` while the model is still on the meta device, freezes everything else, and lets the
parallelizer shard base weights and adapters alike on every layout: FSDP2 puts frozen and trainable parameters in the
same units, TP places each adapter after its base layer (``automodel.distributed.adapters``), DDP replicates them.
The loader reads the base weights from the checkpoint under their original names and fills the adapters with peft's
default init (Kaiming-uniform ``lora_A``, zero ``lora_B``) computed once, identically on every rank.
``merge_lora`` folds trained adapters back into the base weights for an export plain transformers loads.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from automodel.distributed import MegatronFSDPConfig, MeshContext
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import full_tensor
from automodel.loading.checkpoint_files import CheckpointError
from automodel.loading.initialization import local_view
from automodel.loading.placements import local_indices
from automodel.loading.sources import InMemoryTensor, Source, StoredTensor, select
from automodel.lora_checkpoint import ADAPTER_WEIGHTS, LoraAdapter, peft_key, require_peft

__all__ = ["add_lora", "merge_lora", "require_peft"]

_BASE_LAYER = ".base_layer."


def _check_layout(peft_config: Any, mesh_context: MeshContext | None) -> None:
    peft = require_peft()
    if not isinstance(peft_config, peft.LoraConfig):
        raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}.")
    if peft_config.init_lora_weights is not True:
        raise ValueError(
            f"peft_config.init_lora_weights={peft_config.init_lora_weights!r}: the sharded loader initialises "
            "adapters with peft's default (True: Kaiming-uniform lora_A, zero lora_B) only."
        )
    if peft_config.use_dora:
        raise ValueError("peft_config.use_dora=True (DoRA) is not supported: use plain LoRA adapters.")
    if peft_config.bias != "none":
        raise ValueError(
            f"peft_config.bias={peft_config.bias!r} is not supported: only the adapters train here (bias='none'). For a "
            "trainable bias that merges with each adapter, use lora_bias=True."
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        if getattr(peft_config, option, None):
            raise ValueError(f"peft_config.{option}={getattr(peft_config, option)!r} is not supported: {why}.")
    _refuse_parameter_targets(peft_config.target_parameters, "peft_config.target_parameters")
    if mesh_context is None:
        return
    if isinstance(mesh_context.strategy, MegatronFSDPConfig):
        raise ValueError("LoRA runs with strategy='fsdp2' or 'ddp', not 'megatron_fsdp'.")


# LoraConfig options that add trainable tensors other than the factors of linear layers, which are not sharded,
# initialised or saved here.
_UNSUPPORTED_OPTIONS = {
    "modules_to_save": "the full copies of modules peft trains beside the adapters are not sharded or saved here; "
    "leave them out, or train without LoRA",
    "trainable_token_indices": "the trainable rows of an embedding are not sharded or saved here; leave them out, or "
    "train the embedding without LoRA",
    "layer_replication": "replicated layers share their base weights, which the parallelizer shards once each; use a "
    "model with those layers",
}


def _refuse_unsupported_layers(model: nn.Module, lora: Any) -> None:
    """Adapters other than plain LoRA on linear layers (embeddings, convolutions, peft's variants such as aLoRA),
    which the loader would not initialise and ``merge_lora`` would not fold."""
    others = []
    for name, module in model.named_modules():
        if isinstance(module, lora.LoraLayer) and (type(module) is not lora.Linear or module.lora_variant):
            kinds = [type(module).__name__, *(type(variant).__name__ for variant in module.lora_variant.values())]
            others.append(f"{name} ({', '.join(kinds)})")
    if others:
        raise ValueError(
            f"LoRA is supported on linear layers only, as plain LoRA adapters; the config adapts {_few(others)}. "
            "Leave those modules out of target_modules (and variants such as DoRA or aLoRA out of the config)."
        )


def _few(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _refuse_parameter_targets(targets: Any, where: str, modules: Any = None) -> None:
    if targets:
        example = f" (here e.g. target_modules={sorted(modules)!r})" if modules else ""
        raise ValueError(
            f"{where}={sorted(targets)!r}: LoRA on bare parameters (peft's ParamWrapper, e.g. routed experts' stacked "
            "weights or a router's weight) is not supported; adapters on routed experts would have to be split with "
            "them over ep and merged per expert. List the modules to adapt in target_modules (attention, dense MLPs, "
            f"shared experts){example}: they work on every layout, EP and EP x TP included."
        )


def add_lora(
    model: nn.Module,
    peft_config: Any,
    mesh_context: MeshContext | None,
    sources: dict[str, Source],
    *,
    adapter: LoraAdapter | None = None,
    seed: int = 0,
) -> dict[str, Source]:
    """Inject LoRA adapters into ``model`` (on the meta device), freeze everything else, and return the checkpoint
    ``sources`` renamed for the wrapped layers plus a source for every adapter parameter: the factors of ``adapter``
    (an existing peft adapter, whose config is then ``peft_config``), or peft's initial values."""
    _check_layout(peft_config, mesh_context)
    peft = require_peft()
    # A copy: peft records things on the config it is given (the base model's name), which is the caller's.
    injected = copy.deepcopy(peft_config)
    with torch.device("meta"):
        peft.inject_adapter_in_model(injected, model)
    # peft expands target_modules="all-linear" on a MoE model into parameter targets (its fused experts, its router).
    _refuse_parameter_targets(
        injected.target_parameters,
        f"target_modules={peft_config.target_modules!r} made peft target parameters",
        injected.target_modules,
    )
    _refuse_unsupported_layers(model, peft.tuners.lora)
    renamed = dict(sources)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name
        if _BASE_LAYER in name:
            original = name.replace(_BASE_LAYER, ".")
            if original in renamed:
                renamed[name] = renamed.pop(original)
        elif adapter is not None and ".lora_" in name:
            renamed[name] = _stored_factor(adapter, name, tuple(param.shape))
        elif ".lora_A." in name:
            full = torch.empty(param.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)  # peft's default
            renamed[name] = InMemoryTensor(full.to(param.dtype))
        elif ".lora_B." in name:
            renamed[name] = InMemoryTensor(torch.zeros(param.shape, dtype=param.dtype))
    return renamed


def _stored_factor(adapter: LoraAdapter, name: str, shape: tuple[int, ...]) -> Source:
    key = peft_key(name)
    if key not in adapter.files.key_to_file:
        raise CheckpointError(f"{adapter.directory / ADAPTER_WEIGHTS} has no {key} for the model's {name}.")
    stored = adapter.files.shape(key)
    if stored != shape:
        raise CheckpointError(
            f"{adapter.directory / ADAPTER_WEIGHTS}: {key} has shape {stored}, the model's {name} {shape} (another "
            "base model or rank?)."
        )
    return StoredTensor(adapter.files, key, shape)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its (possibly sharded) base weight (and, with ``lora_bias``, its bias into the
    base bias) and put the base layer back in its place, so the model has transformers' own module tree and parameter
    names again (for an export). Under pipeline parallelism each rank folds its stages' adapters. Collective: every
    rank calls it."""
    lora = require_peft().tuners.lora
    whole = model.whole_on_meta if isinstance(model, PipelinedModel) else model  # every layer, on every rank
    biasless = [
        name
        for name, module in whole.named_modules()
        if isinstance(module, lora.LoraLayer)
        and any(module.lora_bias.get(adapter) for adapter in module.active_adapters)
        and getattr(module.base_layer, "bias", None) is None
    ]
    if biasless:
        raise ValueError(
            f"Cannot merge LoRA with lora_bias=True into {_few(biasless)}: the base layer has no bias (peft refuses "
            "this merge too). Export the adapter instead (save_lora_adapter, or export.lora=adapter)."
        )
    for name, module in _lora_layers(model, lora):
        base = module.base_layer
        for adapter in module.active_adapters:
            delta = (
                full_tensor(module.lora_B[adapter].weight).float() @ full_tensor(module.lora_A[adapter].weight).float()
            )
            delta = delta * module.scaling[adapter]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            _add_into(base.weight, delta)
            if module.lora_bias.get(adapter):
                _add_into(base.bias, full_tensor(module.lora_B[adapter].bias).float() * module.scaling[adapter])
        _put_back(model, name, base)
    if isinstance(model, PipelinedModel):
        for name, module in _lora_layers(whole, lora):
            _put_back(whole, name, module.base_layer)
        model.tensors_renamed()
    return model


def _lora_layers(model: nn.Module, lora: Any) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, lora.LoraLayer)]


def _add_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Add the full-size ``full`` to (possibly sharded) ``param``: each rank its own slice of it."""
    local = local_view(param)
    local.add_(select(full, local_indices(param)).to(local.dtype))


def _put_back(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
