"""One simulated rank of ``automodel.plan``: the model built on meta, the checkpoint checked, the mesh built under
torch's fake process group, the model parallelized (or, for a refusal only, planned) as the real run does it, and the
rank's figures (``RankPlan``). It runs in a forked child of the planning helper (``planning_processes``) or, for rank
0, in the calling process."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from automodel._compat.torch import FakeStore
from automodel.distributed import MeshContext
from automodel.distributed.mesh import forget_meshes
from automodel.distributed.parallelizer import parallelizer_for
from automodel.loading.initialization import local_view
from automodel.loading.placements import rank_classes
from automodel.loading.quantized import pop_quantization_scheme
from automodel.loading.sharded_loader import count_reads

from .planning_estimates import activation_estimate, fsdp_sizes_with_unmanaged

__all__ = [
    "DTYPES",
    "OPTIMIZER_STATES",
    "RankPlan",
    "Request",
    "refusal_in_this_process",
    "simulate_here",
    "simulate_in_this_process",
]

#: The load dtypes a plan takes, by name.
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
#: Optimizer state bytes per trainable local element: AdamW keeps two fp32 moments (``exp_avg``, ``exp_avg_sq``).
#: The optimizer states per trainable element, each in the parameter's dtype (torch's AdamW keeps ``exp_avg`` and
#: ``exp_avg_sq`` like the parameter: bf16 states for bf16 weights, as the recipes' ``make_optimizer`` trains them).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}


@dataclass(frozen=True)
class RankPlan:
    """What one simulated rank holds (bytes; see ``docs/plan.md`` for how each figure is made)."""

    rank: int
    stands_for: list[int]  # the ranks with the same local shapes
    param_bytes: int  # this rank's local parameter shards, in the load dtype
    padded_param_bytes: int  # what FSDP2 allocates for them (dim-0 shards padded to a multiple of the group)
    grad_bytes: int  # trainable local shards, in the parameter dtype
    optimizer_bytes: int  # the optimizer's states for the trainable local elements
    checkpoint_read_bytes: int | None  # what the loader reads for this rank (None: no checkpoint files present)
    largest_gather_bytes: int  # the largest FSDP unit unsharded: the all-gather buffer it needs
    activation_bytes_estimate: int | None  # given micro_batch_size and seq_len, with the AC setting
    peak_bytes_estimate: int
    # Under PP: this rank's stages, their decoder layers, and the microbatches whose activations it holds at once
    # (the activation estimate counts them).
    pipeline_stages: list[int] | None = None
    pipeline_layers: int | None = None
    in_flight_microbatches: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this rank."""
        return asdict(self)


@dataclass(frozen=True)
class Request:
    model: str
    world_size: int
    layout: dict[str, Any]
    dtype: torch.dtype
    micro_batch_size: int | None
    seq_len: int | None
    optimizer: str
    trust_remote_code: bool


def refusal_in_this_process(request: Request) -> str | None:
    """Why rank 0 of ``request`` would be refused: the checkpoint check, the mesh and the pipeline split as the run
    makes them (every stage built on meta, so that a stage that cannot run is found here whichever ranks hold it),
    then the planner alone (``check_parallelization``: no TP, no ``fully_shard``) on rank 0's stages; ``None`` when
    it fits."""
    from automodel.distributed.pipeline_stages import build_stage
    from automodel.distributed.planner import check_parallelization
    from automodel.loading.pipeline_stages import split_into_stages

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = Target.resolve(request.model, request.trust_remote_code, request.dtype)
    try:
        with _fake_process_group(0, request.world_size):
            model = target.build()
            simulation = _Simulation(target, request.world_size, _mesh_arguments(request.layout), None, None, "adamw")
            checkpoint = simulation._checkpoint_plan(model)
            if checkpoint is not None:
                checkpoint.files.close()
            context = MeshContext.build(**simulation.layout)
            parallelizer = parallelizer_for(model)
            if context.pipeline is None:
                check_parallelization(parallelizer, model, context)
                return None
            split = split_into_stages(model, context)
            last = context.pipeline.num_stages - 1
            for index in range(context.pipeline.num_stages):
                stage = build_stage(model, split.roles, split.layers(index), first=index == 0, last=index == last)
                if index in context.pipeline.local_stages:
                    check_parallelization(parallelizer, stage, context)
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        return str(error)
    finally:
        torch.set_num_threads(threads)
    return None


def simulate_in_this_process(request: Request, *, classes: bool) -> dict[str, Any]:
    """Rank 0 of ``request`` simulated here (a process without a process group), the thread count kept."""
    threads = torch.get_num_threads()
    try:
        return simulate_here(request, 0, classes=classes)
    finally:
        torch.set_num_threads(threads)


def simulate_here(request: Request, rank: int, classes: bool) -> dict[str, Any]:
    """What a child process computes for one rank (``planning_processes.simulate_elsewhere``)."""
    torch.set_num_threads(1)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a simulated rank needs a process without a process group")
    start = time.perf_counter()
    target = Target.resolve(request.model, request.trust_remote_code, request.dtype)
    layout = _mesh_arguments(request.layout)
    simulation = _Simulation(
        target, request.world_size, layout, request.micro_batch_size, request.seq_len, request.optimizer
    )
    outcome = simulation.rank(rank, classes=classes)
    return {
        "rank": rank,
        "error": outcome.error,
        "figures": None if outcome.figures is None else asdict(outcome.figures),
        "classes": outcome.classes,
        "log": outcome.log,
        "parallel_plans": outcome.parallel_plans,
        "pipeline": outcome.pipeline,
        "total_param_bytes": target.total_bytes,
        "seconds": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _mesh_arguments(layout: dict[str, Any]) -> dict[str, Any]:
    """``layout`` as ``MeshContext.build`` keywords; ``mixed_precision: bf16`` (the recipes' key) is FSDP2 computing
    in bf16 with fp32 gradient reduction, as the recipes build it."""
    arguments = dict(layout)
    if arguments.pop("mixed_precision", "fp32") == "bf16":
        from automodel.distributed import FSDP2Config

        arguments["strategy"] = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return arguments


# ----------------------------------------------------------------------------------------------------------------
# What is planned: the model's config, class and checkpoint files.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    config: PretrainedConfig
    auto_class: type
    directory: Path | None  # a folder holding the weights, whose headers the read plan uses
    dtype: torch.dtype
    trust_remote_code: bool
    quantized: bool
    total_bytes: int = 0

    @staticmethod
    def config_of(model: str | os.PathLike, trust_remote_code: bool) -> tuple[PretrainedConfig, Path]:
        """The model's config and the folder holding it (a hub id's metadata fetched or found in the cache); a model
        that cannot be resolved raises the loader's one-line error (``FileNotFoundError``, ``OSError``,
        ``ValueError``), as the recipes refuse it."""
        from automodel.auto_model import load_config
        from automodel.loading.hub import HubOptions, resolve_config_dir

        directory = resolve_config_dir(model, HubOptions(trust_remote_code=trust_remote_code))
        return load_config(model, directory, trust_remote_code, {}), directory

    @classmethod
    def resolve(cls, model: str | os.PathLike, trust_remote_code: bool, dtype: torch.dtype) -> Target:
        from automodel.auto_model import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText

        config, directory = cls.config_of(model, trust_remote_code)
        quantized = pop_quantization_scheme(config) is not None
        vision = getattr(config, "vision_config", None) is not None
        image_text = type(config) in NeMoAutoModelForImageTextToText._auto_mapping
        auto_class = NeMoAutoModelForImageTextToText if vision and image_text else NeMoAutoModelForCausalLM
        weights = directory if _has_weights(directory) else None
        target = cls(config, auto_class, weights, dtype, trust_remote_code, quantized)
        target.total_bytes = sum(p.numel() * p.element_size() for p in target.build().parameters())
        return target

    def build(self) -> nn.Module:
        return self.auto_class._build_on_meta(self.config, self.dtype, None, self.trust_remote_code)


def _has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds every weight file of a checkpoint (headers only are enough)."""
    from automodel.loading import CheckpointError, open_checkpoint

    try:
        open_checkpoint(directory).close()
    except (CheckpointError, FileNotFoundError, OSError):
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# One simulated rank.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    rank: int
    error: str | None = None
    figures: RankPlan | None = None
    log: list[str] = field(default_factory=list)
    parallel_plans: list[dict[str, Any]] = field(default_factory=list)
    classes: list[list[int]] = field(default_factory=list)
    pipeline: dict[str, Any] | None = None


@dataclass
class _Simulation:
    target: Target
    world_size: int
    layout: dict[str, Any]
    micro_batch_size: int | None
    seq_len: int | None
    optimizer: str

    def rank(self, rank: int, *, classes: bool) -> _Outcome:
        """Build, check the checkpoint, build the mesh and parallelize as rank ``rank`` would; its figures."""
        outcome = _Outcome(rank)
        if not 0 <= rank < self.world_size:
            outcome.error = f"rank {rank} is not a rank of a {self.world_size}-rank job."
            return outcome
        with _fake_process_group(rank, self.world_size):
            stages: _Stages | None = None
            try:
                model = self.target.build()
                checkpoint = self._checkpoint_plan(model)
                context = MeshContext.build(**self.layout)
                if context.pipeline is not None:
                    stages = _Stages.build(model, context)
                    model = stages.modules
                else:
                    model = parallelizer_for(model).parallelize(model, context)
            except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
                outcome.error = str(error)
                return outcome
            read_bytes = None
            if checkpoint is not None:
                read_bytes = stages.reads(checkpoint) if stages else count_reads(model, checkpoint.keys.sources)
                checkpoint.files.close()
            outcome.figures = self._figures(rank, model, context, read_bytes, stages)
            outcome.classes = rank_classes(model, self.world_size) if classes else []
            plans = [module.parallel_plan for module in (stages.modules if stages else [model])]
            outcome.log = [line for plan in plans for line in plan.describe()]
            outcome.parallel_plans = [plan.to_dict() for plan in plans]
            outcome.pipeline = stages.facts(context) if stages else None
        return outcome

    def _checkpoint_plan(self, model: nn.Module):
        if self.target.directory is None or self.target.quantized:
            return None
        from automodel.loading.loader import plan_checkpoint

        return plan_checkpoint(model, self.target.directory)

    def _figures(
        self, rank: int, model: nn.Module, context: MeshContext, read_bytes: int | None, stages: _Stages | None
    ) -> RankPlan:
        params = list(model.parameters())
        local = [(local_view(p).numel() * p.element_size(), p) for p in params]
        trainable = [(size, p) for size, p in local if p.requires_grad]
        grad_bytes = sum(size for size, _ in trainable)
        optimizer = grad_bytes * OPTIMIZER_STATES[self.optimizer]
        padded, largest_gather = fsdp_sizes_with_unmanaged(model, params)
        activations = activation_estimate(
            context, self.target.config, self.micro_batch_size, self.seq_len, self.target.dtype, stages
        )
        # Two all-gather buffers: the unit running and the one prefetched.
        peak = padded + grad_bytes + optimizer + 2 * largest_gather + (activations or 0)
        return RankPlan(
            rank=rank,
            stands_for=[rank],
            param_bytes=sum(size for size, _ in local),
            padded_param_bytes=padded,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer,
            checkpoint_read_bytes=read_bytes,
            largest_gather_bytes=largest_gather,
            activation_bytes_estimate=activations,
            peak_bytes_estimate=peak,
            pipeline_stages=None if stages is None else list(context.pipeline.local_stages),
            pipeline_layers=None if stages is None else stages.local_layers(context),
            in_flight_microbatches=None if stages is None else context.pipeline.in_flight(),
        )


@dataclass
class _Stages:
    """This rank's pipeline stages, parallelized on meta as the real load builds them."""

    modules: nn.ModuleList
    split: Any  # automodel.loading.pipeline_stages.StageSplit
    aliases: dict[str, str]

    @classmethod
    def build(cls, model: nn.Module, context: MeshContext) -> _Stages:
        from automodel.loading.pipeline_stages import parallelized_stage, split_into_stages, tied_aliases

        split = split_into_stages(model, context)
        stages = [parallelized_stage(model, split, index, context) for index in context.pipeline.local_stages]
        return cls(nn.ModuleList(stages), split, tied_aliases(model))

    def reads(self, checkpoint) -> int:
        from automodel.loading.pipeline_stages import stage_checkpoint_plan

        return sum(
            count_reads(stage, stage_checkpoint_plan(checkpoint, stage, self.aliases).keys.sources)
            for stage in self.modules
        )

    def local_layers(self, context: MeshContext) -> int:
        return sum(self.split.layer_counts[index] for index in context.pipeline.local_stages)

    def facts(self, context: MeshContext) -> dict[str, Any]:
        layout = context.pipeline
        return {
            "schedule": layout.schedule,
            "stages": layout.num_stages,
            "ranks": layout.size,
            "virtual_stages": layout.virtual_stages,
            "microbatches": layout.microbatches,
            "layers_per_stage": list(self.split.layer_counts),
            "bubble": layout.ideal_bubble(),
        }


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        forget_meshes()
        dist.destroy_process_group()
