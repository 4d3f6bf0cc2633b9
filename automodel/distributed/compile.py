"""Compiled blocks: ``torch.compile`` on each decoder block, the torchtitan pattern.

Each block's ``forward`` is replaced, in place, by its compiled version (module names, and so checkpoint keys and
plans, are unchanged). What runs inside is what TP and activation checkpointing installed on the block and its
modules (their forward transforms and checkpoint wrappers are traced); FSDP2's unshard / reshard hooks live on the
block itself, around ``forward``, so the collectives of the data-parallel shard stay outside the compiled graph (what
torchtitan does by compiling each block before ``fully_shard``). The blocks share one code object, so with dynamo's
inlined module parameters one compiled graph serves every block of a model.

Compilation happens lazily at the first forward (and again when the grad mode or input shapes change); on CPU inductor
generates C++ and needs a compiler (``g++``, ``CXX``).
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import MegatronFSDPConfig
from .model_structure import decoder_layers

if TYPE_CHECKING:
    from .mesh import MeshContext

__all__ = ["check_compile", "compile_blocks"]


def check_compile(context: MeshContext) -> None:
    """Raise, before the model is touched, where compiled blocks cannot apply to ``context``'s layout or machine."""
    if context.ep_size > 1:
        raise ValueError(
            f"compile=True with ep_size={context.ep_size} is not supported: the expert all-to-all sends a data-"
            "dependent number of tokens per rank, which breaks a block's graph at every exchange. Use compile=False "
            "with expert parallelism, or ep_size=1."
        )
    if isinstance(context.strategy, MegatronFSDPConfig):
        raise ValueError(
            "compile=True with strategy='megatron_fsdp' is not supported (its parameter buffers are swapped in around "
            "each module's forward, outside what a compiled block may capture). Use strategy='fsdp2' to compile."
        )
    if context.device_type == "cpu" and _cpp_compiler() is None:
        raise RuntimeError(
            "compile=True on CPU runs torch.compile's inductor backend, which generates C++ and needs a compiler, and "
            "none was found (g++, c++, clang++ or $CXX). Install one (apt-get install g++) or use compile=False."
        )


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of each decoder block of ``model`` in place; returns how many."""
    blocks = decoder_layers(model)
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)


def _cpp_compiler() -> str | None:
    candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    return next((path for name in candidates if name and (path := shutil.which(name))), None)
