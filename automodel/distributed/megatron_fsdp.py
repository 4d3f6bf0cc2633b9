"""The shared Megatron-FSDP path (the optional ``megatron-fsdp`` package; CUDA only)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from .config import MegatronFSDPConfig
from .mesh import MeshContext
from .model_structure import decoder_layers

__all__ = ["apply_megatron_fsdp", "megatron_fsdp_arguments", "require_megatron_fsdp"]


def require_megatron_fsdp() -> ModuleType:
    """Import ``megatron_fsdp``, or raise a clear error when CUDA or the package is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "The Megatron-FSDP strategy needs CUDA GPUs, and torch.cuda.is_available() is False on this machine. "
            "Use strategy='fsdp2' on CPU."
        )
    try:
        return importlib.import_module("megatron_fsdp")
    except ImportError as error:
        raise ImportError(
            "strategy='megatron_fsdp' needs the megatron-fsdp package: pip install 'automodel[megatron]'."
        ) from error


def megatron_fsdp_arguments(model: nn.Module, context: MeshContext) -> dict:
    """The keyword arguments ``megatron_fsdp.fully_shard_model`` receives for ``model`` under ``context``."""
    config = context.strategy
    assert isinstance(config, MegatronFSDPConfig), f"needs a MegatronFSDPConfig, got {type(config).__name__}"
    unit_classes = sorted({type(layer) for layer in decoder_layers(model)}, key=lambda cls: cls.__name__)
    return {
        "module": model,
        "device_mesh": context.device_mesh,
        "dp_shard_dim": "dp_shard_cp",
        "dp_outer_dim": "dp_replicate" if context.dp_replicate_size > 1 else None,
        "tp_dim": "tp",
        "hybrid_fsdp_group": context.mesh("dp_cp").get_group() if context.dp_replicate_size > 1 else None,
        "fsdp_unit_modules": unit_classes,
        # Built on the meta device and loaded afterwards: Megatron-FSDP then allocates only each rank's shard.
        "init_model_with_meta_device": any(param.is_meta for param in model.parameters()),
        **config.megatron_kwargs(),
    }


def apply_megatron_fsdp(model: nn.Module, context: MeshContext) -> nn.Module:
    """Shard ``model`` (already TP-sharded and checkpointed by the caller) with Megatron-FSDP.

    Megatron-FSDP returns its own ``MegatronFSDP`` wrapper; the model is its ``.module``.
    """
    megatron_fsdp = require_megatron_fsdp()
    return megatron_fsdp.fully_shard_model(**megatron_fsdp_arguments(model, context))
