"""``Layout``: the pure sizes of a parallel layout and its strategy, and the one home of their refusals.

No process group and no model is needed: ``MeshContext.build`` checks its request here before it builds meshes, the
recipes' config check and the pre-launch check before they start any process, and ``automodel plan`` before it
simulates a rank. Each refusal names the option and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DDPConfig, MegatronFSDPConfig, StrategyConfig, strategy_from_name
from .pipeline_layout import check_pipeline

__all__ = ["Layout", "LayoutSizes", "check_layout"]


@dataclass(frozen=True)
class LayoutSizes:
    """What a valid layout resolves to: ``dp_shard`` (inferred), ``dp`` (ranks that see different batches) and the
    pipeline's microbatches per step (1 without PP)."""

    dp_shard: int
    dp: int
    microbatches: int


@dataclass(frozen=True)
class Layout:
    """The sizes of each axis over ``world_size`` ranks (``dp_shard`` is inferred as ``world_size / (pp_size *
    dp_replicate_size * cp_size * tp_size)``), the strategy, sequence parallelism and the pipeline's schedule."""

    strategy: StrategyConfig | str
    world_size: int
    pp_size: int = 1
    dp_replicate_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1

    def validate(self, *, pipeline: bool = True) -> LayoutSizes:
        """Raise, naming the option and the fix, for a layout that cannot run; the resolved sizes. ``pipeline=False``
        leaves the schedule's checks out (a caller that checks them with its own microbatch count)."""
        strategy = strategy_from_name(self.strategy)
        _check_positive(pp_size=self.pp_size)
        microbatches = 1
        if self.pp_size > 1 and pipeline:
            microbatches = check_pipeline(
                strategy,
                self.pp_size,
                self.pp_schedule,
                self.pp_microbatches,
                self.pp_virtual_stages,
                ep_size=self.ep_size,
                cp_size=self.cp_size,
            )
        if self.world_size % self.pp_size:
            raise ValueError(f"pp_size={self.pp_size} does not divide the world size {self.world_size}.")
        dp_shard = _validate_layout(
            strategy,
            self.world_size // self.pp_size,
            self.dp_replicate_size,
            self.tp_size,
            self.cp_size,
            self.ep_size,
            self.sequence_parallel,
        )
        return LayoutSizes(dp_shard, self.dp_replicate_size * dp_shard, microbatches)


def check_layout(
    strategy: str | StrategyConfig,
    world_size: int,
    *,
    dp_replicate_size: int = 1,
    tp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, int]:
    """What ``MeshContext.build`` would check of one stage group's ``world_size`` ranks, without a process group (e.g.
    before launching them): raises the same errors; returns the inferred ``dp_shard`` and ``dp`` sizes."""
    sizes = Layout(
        strategy,
        world_size,
        dp_replicate_size=dp_replicate_size,
        tp_size=tp_size,
        cp_size=cp_size,
        ep_size=ep_size,
        sequence_parallel=sequence_parallel,
    ).validate()
    return {"dp_shard": sizes.dp_shard, "dp": sizes.dp}


def _check_positive(**sizes: int) -> None:
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}.")


def _validate_layout(
    strategy: StrategyConfig,
    world_size: int,
    dp_replicate_size: int,
    tp_size: int,
    cp_size: int,
    ep_size: int,
    sequence_parallel: bool,
) -> int:
    """Check the requested layout against the world size and the strategy; return the inferred ``dp_shard`` size."""
    _check_positive(dp_replicate_size=dp_replicate_size, tp_size=tp_size, cp_size=cp_size, ep_size=ep_size)
    if isinstance(strategy, DDPConfig):
        extras = {"dp_replicate_size": dp_replicate_size, "tp_size": tp_size, "cp_size": cp_size, "ep_size": ep_size}
        bad = {name: size for name, size in extras.items() if size != 1}
        if bad:
            names = ", ".join(f"{name}={size}" for name, size in bad.items())
            raise ValueError(
                f"The DDP strategy replicates the whole model on every rank, so {names} cannot apply: DDP uses all "
                f"{world_size} ranks for data parallelism. Use strategy='fsdp2' for HSDP, TP, CP or EP."
            )
    if isinstance(strategy, MegatronFSDPConfig) and (cp_size > 1 or ep_size > 1):
        bad = ", ".join(f"{name}={size}" for name, size in (("cp_size", cp_size), ("ep_size", ep_size)) if size > 1)
        raise ValueError(
            f"strategy='megatron_fsdp' with {bad} is not supported: context and expert parallelism run with "
            "strategy='fsdp2' (the unified MoE path shards experts with FSDP2)."
        )
    if isinstance(strategy, MegatronFSDPConfig) and not torch.cuda.is_available():
        raise RuntimeError(
            "strategy='megatron_fsdp' needs CUDA GPUs, and torch.cuda.is_available() is False on this machine. "
            "Use strategy='fsdp2' on CPU."
        )
    if sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True shards activations over the TP ranks: it needs tp_size > 1.")
    non_shard = dp_replicate_size * cp_size * tp_size
    if world_size % non_shard:
        raise ValueError(
            f"dp_replicate_size * cp_size * tp_size = {dp_replicate_size} * {cp_size} * {tp_size} = {non_shard} does "
            f"not divide the world size {world_size}; dp_shard is inferred as world_size / that product."
        )
    dp_shard = world_size // non_shard
    if ep_size > 1 and (dp_shard * cp_size * tp_size) % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide dp_shard * cp_size * tp_size = {dp_shard} * {cp_size} * {tp_size} = "
            f"{dp_shard * cp_size * tp_size} (the ranks of one data-parallel replica)."
        )
    return dp_shard
