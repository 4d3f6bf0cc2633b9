"""The layout section of a recipe config as ``MeshContext.build`` keywords (what the run builds and what
``automodel plan`` simulates)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from automodel.distributed import FSDP2Config, MeshContext

from .config import RESHARD_POLICIES, LayoutSection, RecipeConfig, pipeline_microbatches

__all__ = ["build_mesh_context", "mesh_arguments"]


def build_mesh_context(config: RecipeConfig) -> MeshContext:
    """The ``MeshContext`` the layout section describes (under PP with the step's microbatch count)."""
    arguments = mesh_arguments(config.layout)
    if config.layout.pp_size > 1:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        arguments["pp_microbatches"] = pipeline_microbatches(config, world_size)
    return MeshContext.build(**arguments)


def mesh_arguments(layout: LayoutSection) -> dict[str, Any]:
    """The ``MeshContext.build`` keywords of a layout section (also what ``automodel plan`` simulates)."""
    strategy: str | FSDP2Config = layout.strategy
    if layout.mixed_precision == "bf16" and layout.strategy != "fsdp2":
        raise ValueError("layout.mixed_precision=bf16 is implemented with FSDP2: set layout.strategy=fsdp2.")
    if layout.strategy == "fsdp2":
        bf16 = layout.mixed_precision == "bf16"
        strategy = FSDP2Config(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
            reshard_after_forward=RESHARD_POLICIES[layout.reshard_after_forward],
            prefetch=layout.prefetch,
        )
    arguments = {
        "strategy": strategy,
        "dp_replicate_size": layout.dp_replicate_size,
        "tp_size": layout.tp_size,
        "cp_size": layout.cp_size,
        "ep_size": layout.ep_size,
        "sequence_parallel": layout.sequence_parallel,
        "activation_checkpointing": layout.activation_checkpointing,
        "compile": layout.compile,
    }
    if layout.pp_size > 1:
        arguments.update(
            pp_size=layout.pp_size, pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.pp_virtual_stages
        )
    return arguments
