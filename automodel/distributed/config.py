"""Typed, frozen strategy configurations: what the user asks for, before any mesh exists.

Each config names one data-parallel strategy. ``MeshContext.build(strategy=...)`` accepts either one of these objects
or its short name (``"fsdp2"``, ``"ddp"``, ``"megatron_fsdp"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["DDPConfig", "FSDP2Config", "MegatronFSDPConfig", "MoEConfig", "StrategyConfig", "strategy_from_name"]


@dataclass(frozen=True)
class FSDP2Config:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) settings.

    Mixed precision is opt-in: with ``param_dtype=None`` the model computes in the dtype it was loaded in.

    Args:
        param_dtype: dtype parameters are all-gathered and computed in (``torch.bfloat16`` for bf16 training).
        reduce_dtype: dtype gradients are reduced in (``torch.float32`` keeps bf16 training stable).
        output_dtype: dtype the root module's floating-point outputs are cast to.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
        reshard_after_forward: ``None`` (the default, torchtitan's policy): every unit frees its unsharded
            parameters after forward but the last decoder layer and the output head, whose backward follows at once,
            so their unsharded size is held from forward to backward instead of all-gathering them again at once;
            ``True``: every unit (ZeRO-3); ``False``: none (ZeRO-2: the whole model stays unsharded from forward to
            backward and through gradient accumulation, one all-gather per unit per step). Whatever the policy, a
            forward no backward can follow (under ``torch.no_grad()``, or with no output needing a gradient) reshards
            every unit at its end.
        prefetch: each decoder layer's forward starts the next layer's all-gather before it computes, and each
            layer's backward the previous one's (explicit FSDP2 prefetch): transfers overlap computation, for one
            more layer's unsharded parameters in flight.
    """

    name = "fsdp2"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool | None = None
    prefetch: bool = True

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """The ``MixedPrecisionPolicy`` these settings describe, or ``None`` when mixed precision is off."""
        if self.param_dtype is None and self.reduce_dtype is None and self.output_dtype is None:
            return None
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, output_dtype=self.output_dtype
        )

    def offload_policy(self) -> OffloadPolicy | None:
        """``CPUOffloadPolicy()`` when ``cpu_offload`` is set, else ``None``."""
        return CPUOffloadPolicy() if self.cpu_offload else None


@dataclass(frozen=True)
class DDPConfig:
    """Distributed data parallel settings (every rank holds the whole model; gradients are all-reduced).

    Args:
        bucket_cap_mb: gradient bucket size for the all-reduce.
        find_unused_parameters: set when some parameters get no gradient in a step (slower).
        gradient_as_bucket_view: let gradients alias the communication buckets (saves one copy).
    """

    name = "ddp"
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True


@dataclass(frozen=True)
class MegatronFSDPConfig:
    """Megatron-FSDP settings (the ``megatron-fsdp`` package; CUDA only).

    Args:
        zero_dp_strategy: 0 = no sharding, 1 = optimizer, 2 = + gradients, 3 = + parameters.
        overlap_grad_reduce: overlap the gradient reduce-scatter with backward compute.
        overlap_param_gather: overlap the parameter all-gather with forward compute.
        preserve_fp32_weights: keep an fp32 main copy of low-precision weights (Megatron-FSDP's
            ``MixedPrecisionPolicy(main_params_dtype=torch.float32)``; ``None`` otherwise).
        calculate_per_token_loss: scale gradients per token instead of per sample.
        keep_fp8_transpose_cache: keep FP8 transposes between forward and backward.
    """

    name = "megatron_fsdp"
    zero_dp_strategy: Literal[0, 1, 2, 3] = 3
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    preserve_fp32_weights: bool = True
    calculate_per_token_loss: bool = False
    keep_fp8_transpose_cache: bool = False

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``megatron_fsdp.fully_shard_model`` (everything but the module and meshes)."""
        return {
            "zero_dp_strategy": self.zero_dp_strategy,
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "overlap_param_gather": self.overlap_param_gather,
            "calculate_per_token_loss": self.calculate_per_token_loss,
            "keep_fp8_transpose_cache": self.keep_fp8_transpose_cache,
        }


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts policy used by the unified MoE TP + CP + EP + FSDP path.

    Args:
        save_router_decisions: under activation checkpointing, record the routers' top-k results in forward and
            replay them in the backward recomputation instead of recomputing them (a recomputed top-k can route
            differently on GPU). Applies with and without EP.
    """

    save_router_decisions: bool = True


StrategyConfig = FSDP2Config | DDPConfig | MegatronFSDPConfig

_STRATEGIES: dict[str, type] = {cls.name: cls for cls in (FSDP2Config, DDPConfig, MegatronFSDPConfig)}


def strategy_from_name(strategy: str | StrategyConfig) -> StrategyConfig:
    """Return the strategy config for a short name, or the config itself when one is given."""
    if isinstance(strategy, (FSDP2Config, DDPConfig, MegatronFSDPConfig)):
        return strategy
    if isinstance(strategy, str) and strategy in _STRATEGIES:
        return _STRATEGIES[strategy]()
    raise ValueError(
        f"Unknown strategy {strategy!r}. Use one of {sorted(_STRATEGIES)} or pass an FSDP2Config, DDPConfig or "
        "MegatronFSDPConfig object."
    )
