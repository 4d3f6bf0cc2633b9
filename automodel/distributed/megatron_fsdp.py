"""The shared Megatron-FSDP path (the optional ``megatron-fsdp`` package; CUDA only)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from .config import MegatronFSDPConfig
from .mesh import MeshContext
from .model_structure import decoder_layers

__all__ = [
    "apply_megatron_fsdp",
    "install_loaded_weights",
    "is_megatron_fsdp_parameter",
    "megatron_fsdp_arguments",
    "megatron_fsdp_local_indices",
    "require_megatron_fsdp",
]


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
    arguments = megatron_fsdp_arguments(model, context)
    if arguments["init_model_with_meta_device"]:
        _allow_meta_init(model)
    main_params_dtype = torch.float32 if context.strategy.preserve_fp32_weights else None
    arguments["mixed_precision_policy"] = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=main_params_dtype)
    return megatron_fsdp.fully_shard_model(**arguments)


def _no_reset() -> None:
    return None


def _allow_meta_init(model: nn.Module) -> None:
    """Megatron-FSDP allocates meta parameters module by module and then calls the module's ``reset_parameters`` or
    ``_reset_parameters``; some transformers modules (RMS norms, fused experts) have neither. The loader fills every
    weight right afterwards (from the checkpoint, or ``from_config``'s reference), so those get a no-op."""
    for module in model.modules():
        owns_meta = any(param.is_meta for param in module.parameters(recurse=False))
        if owns_meta and not hasattr(module, "reset_parameters") and not hasattr(module, "_reset_parameters"):
            module._reset_parameters = _no_reset


def is_megatron_fsdp_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a (possibly unevenly) sharded parameter managed by Megatron-FSDP."""
    return bool(getattr(tensor, "__fsdp_param__", False))


def megatron_fsdp_local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """For each dim, the global indices this rank's shard of a Megatron-FSDP parameter holds.

    Megatron-FSDP shards its flat buffers unevenly, so the shard's offsets come from its own chunk metadata (one
    all-gather of shapes over the shard group), not from the DTensor placements' even-split rule.
    """
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    chunk = gather_and_compute_chunk_metadata(tensor)
    return [torch.arange(offset, offset + size) for offset, size in zip(chunk.offsets, chunk.sizes, strict=True)]


def install_loaded_weights(model: nn.Module) -> None:
    """Megatron-FSDP computes with its own weight buffers: copy the weights just loaded into its (main) parameters
    there. A no-op for every other model."""
    install = getattr(model, "install_optimized_model_weights", None)
    if callable(install):
        install()
