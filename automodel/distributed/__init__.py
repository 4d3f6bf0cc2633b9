"""Shared distributed infrastructure: meshes, strategy dispatch, TP plans, activation checkpointing, FSDP2 / DDP /
Megatron-FSDP setup.

``__all__`` lists every symbol a model sidecar may import, and nothing else. This package never imports a model,
a sidecar, the loader or the training code.
"""

from .activation_checkpointing import checkpoint_module
from .config import DDPConfig, FSDP2Config, MegatronFSDPConfig, MoEConfig
from .fsdp import fully_shard_by_dtype, fully_shard_default, shard_default_units
from .mesh import MeshContext
from .model_structure import decoder_layers, tied_module_groups
from .parallelizer import ModelParallelizer

__all__ = [
    "DDPConfig",
    "FSDP2Config",
    "MegatronFSDPConfig",
    "MeshContext",
    "MoEConfig",
    "ModelParallelizer",
    "checkpoint_module",
    "decoder_layers",
    "fully_shard_by_dtype",
    "fully_shard_default",
    "shard_default_units",
    "tied_module_groups",
]
