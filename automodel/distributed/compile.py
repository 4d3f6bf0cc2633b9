"""Compiled blocks: ``torch.compile`` on each decoder block, the torchtitan pattern.

Each block's ``forward`` is replaced, in place, by its compiled version (module names, and so checkpoint keys and
plans, are unchanged). What runs inside is what TP and activation checkpointing installed on the block and its
modules (their forward transforms and checkpoint wrappers are traced); FSDP2's unshard / reshard hooks live on the
block itself, around ``forward``, so the collectives of the data-parallel shard stay outside the compiled graph (what
torchtitan does by compiling each block before ``fully_shard``). The blocks share one code object, so with dynamo's
inlined module parameters one compiled graph serves every block of a model.

``MeshContext.compile`` is ``"auto"`` by default: compiled blocks where the mesh's device is CUDA (where they are
measured faster), eager on CPU; ``True`` / ``False`` force it. A layout whose blocks cannot be compiled (expert
parallelism, Megatron-FSDP, CPU without a C++ compiler) runs them eagerly under ``"auto"`` and says why once; an
explicit ``compile=True`` there is refused before the model is touched. A block class whose compilation fails at its
first forward (a backend error, an op dynamo cannot trace) runs eagerly from then on: said once per block class with
the reason, never fatal.

A call with a KV cache (generation, ``use_cache=True``) runs the block eagerly: the cache's per-layer state would make
dynamo compile each layer separately and give up at its recompile limit. ``train_step`` passes ``use_cache=False``; a
training forward of the user's own that leaves transformers' default cache on is warned once.

Sequence lengths: dynamo's automatic dynamic shapes mark a dimension dynamic the first time it changes, so a model fed
variable lengths compiles twice (the first shape, then one graph for every length), not once per length.
Compilation happens lazily at the first forward (and again when the grad mode changes); on CPU inductor generates C++
and needs a compiler (``g++``, ``CXX``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Cache

from automodel._compat.torch import TorchDynamoException

from .config import MegatronFSDPConfig
from .model_structure import decoder_layers
from .runtime import log_rank_zero

if TYPE_CHECKING:
    from .mesh import MeshContext

__all__ = ["CompileDecision", "check_compile", "compile_blocks", "decide_compile", "eager_block_classes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileDecision:
    """Whether decoder blocks are compiled, and why (``"auto, cuda"``, ``"compile=True"``, or the reason they run
    eagerly)."""

    enabled: bool
    why: str


def decide_compile(context: MeshContext) -> CompileDecision:
    """Resolve ``context.compile`` (``"auto"``, ``True`` or ``False``) against the layout and the machine.

    Raises where an explicit ``compile=True`` cannot apply; under ``"auto"`` the same reasons turn compilation off.
    """
    request = context.compile
    if request is False:
        return CompileDecision(False, "compile=False")
    if request == "auto" and context.device_type != "cuda":
        return CompileDecision(False, f"auto, {context.device_type}")
    obstacle = _obstacle(context)
    if obstacle is None:
        return CompileDecision(True, f"auto, {context.device_type}" if request == "auto" else "compile=True")
    reason, refusal = obstacle
    if request is True:
        raise refusal
    return CompileDecision(False, f"auto, {context.device_type}; blocks run eagerly: {reason}")


def check_compile(context: MeshContext) -> None:
    """Raise, before the model is touched, where an explicit ``compile=True`` cannot apply to ``context``'s layout or
    machine (``"auto"`` never raises: it runs the blocks eagerly there)."""
    decide_compile(context)


def _obstacle(context: MeshContext) -> tuple[str, Exception] | None:
    """Why compiled blocks cannot apply to this layout or machine: a short reason, and the error an explicit
    ``compile=True`` gets."""
    if context.ep_size > 1:
        return "the expert all-to-all sends a data-dependent number of tokens", ValueError(
            f"compile=True with ep_size={context.ep_size} is not supported: the expert all-to-all sends a data-"
            "dependent number of tokens per rank, which breaks a block's graph at every exchange. Use compile=False "
            "(or 'auto') with expert parallelism, or ep_size=1."
        )
    if isinstance(context.strategy, MegatronFSDPConfig):
        return "Megatron-FSDP swaps parameter buffers in outside the block", ValueError(
            "compile=True with strategy='megatron_fsdp' is not supported (its parameter buffers are swapped in around "
            "each module's forward, outside what a compiled block may capture). Use strategy='fsdp2' to compile."
        )
    if context.device_type == "cpu" and _cpp_compiler() is None:
        return "no C++ compiler for inductor", RuntimeError(
            "compile=True on CPU runs torch.compile's inductor backend, which generates C++ and needs a compiler, and "
            "none was found (g++, c++, clang++ or $CXX). Install one (apt-get install g++) or use compile=False."
        )
    return None


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of each decoder block of ``model`` in place, the blocks of a class falling back to their
    eager forward together when that class fails to compile; returns how many blocks."""
    blocks = decoder_layers(model)
    failed: dict[type | str, str] = {}  # block class -> why it runs eagerly; shared by this model's blocks
    for block in blocks:
        block.forward = _compiled_or_eager(type(block), block.forward, failed)
    return len(blocks)


def eager_block_classes(model: nn.Module) -> dict[str, str]:
    """The block classes of ``model`` whose compilation failed, with the reason (they run eagerly)."""
    found: dict[str, str] = {}
    for block in decoder_layers(model):
        failed = getattr(block.forward, "failed", {})
        found.update({cls.__name__: reason for cls, reason in failed.items() if isinstance(cls, type)})
    return found


def _compiled_or_eager(
    block_class: type, eager: Callable[..., Any], failed: dict[type | str, str]
) -> Callable[..., Any]:
    compiled = torch.compile(eager)

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if block_class in failed:
            return eager(*args, **kwargs)
        if any(isinstance(value, Cache) for value in kwargs.values()):
            if torch.is_grad_enabled() and "cache" not in failed:
                failed["cache"] = "a training forward passed a KV cache"
                log_rank_zero(
                    logger,
                    "compile: a forward with gradients passed a KV cache to the %s blocks (transformers creates one "
                    "unless use_cache=False), so they ran eagerly; pass use_cache=False to train compiled, as "
                    "automodel's train_step does",
                    block_class.__name__,
                    level=logging.WARNING,
                )
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as error:
            # Raised while dynamo traced or the backend compiled, before the graph ran: the eager forward is safe to
            # run instead, and it raises the real error itself if the block's own code is at fault.
            failed[block_class] = reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            log_rank_zero(
                logger,
                "compile: %s blocks run eagerly (their compilation failed: %s)",
                block_class.__name__,
                reason,
                level=logging.WARNING,
            )
            return eager(*args, **kwargs)

    forward.compiled = compiled  # type: ignore[attr-defined]
    forward.failed = failed  # type: ignore[attr-defined]
    return forward


def _cpp_compiler() -> str | None:
    candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    return next((path for name in candidates if name and (path := shutil.which(name))), None)
