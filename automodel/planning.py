"""Plan before you pay: ``automodel.plan(model, world_size=N, layout=...)`` runs the project's own build-on-meta and
``parallelize`` for simulated ranks of an N-rank job, each in a child process under torch's fake process group (every
collective returns at once), and reports what each rank would hold: its parameter shards, gradients, optimizer
states, the bytes it reads from the checkpoint, its largest FSDP all-gather, an activation estimate and a peak.

No parameter memory is allocated (the model stays on the meta device) and no checkpoint data is read (only the
safetensors headers, where the files are present). Every figure comes from the objects the real run builds: the
``DTensor`` local shapes, FSDP2's own padded shards and all-gather sizes, the loader's own read plan. A layout the
real run refuses is refused here with the real run's message, since it is the same code that raises.

Which ranks: without ``ranks``, rank 0, the last rank, and one rank of every class of ranks whose local shards have
the same shapes (the first and last chunks of an uneven split, the ranks past its end, ...); each result says which
ranks it stands for. Simulating a rank of an 8,192-rank job takes seconds (most of it torch's ``fully_shard``, whose
cost per parameter grows with the shard group: ``docs/performance.md``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
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
from .planning_processes import SimulationError, simulate_elsewhere
from .planning_table import describe_ranks, shown_layout

__all__ = ["Plan", "RankPlan", "SimulationError", "layout_refusal", "plan"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
#: Optimizer state bytes per trainable local element: AdamW keeps two fp32 moments (``exp_avg``, ``exp_avg_sq``).
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}


@dataclass(frozen=True)
class RankPlan:
    """What one simulated rank holds (bytes; see ``docs/plan.md`` for how each figure is made)."""

    rank: int
    stands_for: list[int] | str  # the ranks with the same local shapes ("512 ranks: 0-511" past 16 of them)
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
class Plan:
    """The plan of one layout: ``ok`` and ``error`` (the exact message the real run would raise), the model's total
    parameter bytes, one :class:`RankPlan` per simulated rank class, and the lines the parallelizer logs."""

    world_size: int
    ok: bool
    error: str | None
    total_param_bytes: int
    ranks: list[RankPlan] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)
    #: What each simulation cost: ``{"rank", "seconds", "peak_rss_bytes"}`` per simulated rank (its own process).
    simulation: list[dict[str, Any]] = field(default_factory=list)
    #: Under PP: ``{"schedule", "stages", "ranks", "virtual_stages", "microbatches", "layers_per_stage", "bubble"}``
    #: (``bubble``: the ideal idle share of a step, ``(P - 1) / (V M + P - 1)``).
    pipeline: dict[str, Any] | None = None
    #: ``{"micro_batch_size", "seq_len"}`` the activations were estimated for (``None``: they were not).
    batch: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``automodel plan --json`` prints."""
        return {**asdict(self), "ranks": [rank.to_dict() for rank in self.ranks]}

    def table(self) -> str:
        """A readable report: the verdict, the log lines, and one row per rank class (``planning_table``)."""
        from .planning_table import plan_table

        return plan_table(self)


def plan(
    model: str | os.PathLike,
    *,
    world_size: int,
    layout: Mapping[str, Any] | None = None,
    ranks: Sequence[int] | None = None,
    dtype: str | torch.dtype = "bf16",
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    trust_remote_code: bool = False,
) -> Plan:
    """Plan ``model`` (a local checkpoint folder or a hub id: its config, and the safetensors headers where the
    files are present) on ``world_size`` ranks with ``layout`` (the keyword arguments of ``MeshContext.build``:
    ``strategy``, ``dp_replicate_size``, ``tp_size``, ``cp_size``, ``ep_size``, ``sequence_parallel``,
    ``activation_checkpointing`` ...). ``ranks`` picks the simulated ranks (default: a representative set).

    Each simulated rank runs in a fresh child process under torch's fake process group (up to 4 at a time), so
    this works from any process, one that runs a real process group included.
    """
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(_OPTIMIZER_STATE_BYTES)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype))
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)}.")
    request = _Request(
        str(model), world_size, dict(layout or {}), torch_dtype, micro_batch_size, seq_len, optimizer, trust_remote_code
    )
    _Target.config_of(request.model, trust_remote_code)  # a model that cannot be resolved: its one line, here
    first = simulate_elsewhere(request, ranks[0] if ranks else 0, classes=not ranks)
    layout = shown_layout(request.layout)
    if first["error"] is not None:
        return Plan(world_size, False, first["error"], first["total_param_bytes"], layout=layout)
    if ranks:
        chosen = {rank: [rank] for rank in ranks}
    elif first["pipeline"] is not None:
        chosen = _pipeline_ranks(first["classes"], first["pipeline"]["ranks"], world_size)
    else:
        # Each class by its first rank, the last rank's class by the last rank.
        chosen = {members[-1] if members[-1] == world_size - 1 else members[0]: members for members in first["classes"]}
    if first["rank"] not in chosen:  # rank 0 and the last one in one class of several: both are shown
        chosen[first["rank"]] = chosen[world_size - 1]
    others = [rank for rank in chosen if rank != first["rank"]]
    with ThreadPoolExecutor(max_workers=max(1, min(len(others), os.cpu_count() or 1, 4))) as pool:
        outcomes = [first, *pool.map(lambda rank: simulate_elsewhere(request, rank, classes=False), others)]
    failed = next((outcome for outcome in outcomes if outcome["error"] is not None), None)
    if failed is not None:
        return Plan(world_size, False, failed["error"], first["total_param_bytes"], layout=layout)
    results = sorted(
        (_standing_for(RankPlan(**outcome["figures"]), chosen[outcome["rank"]]) for outcome in outcomes),
        key=lambda result: result.rank,
    )
    costs = [{key: outcome[key] for key in ("rank", "seconds", "peak_rss_bytes")} for outcome in outcomes]
    batch = {"micro_batch_size": micro_batch_size, "seq_len": seq_len} if micro_batch_size and seq_len else None
    return Plan(
        world_size,
        True,
        None,
        first["total_param_bytes"],
        results,
        first["log"],
        layout,
        costs,
        first["pipeline"],
        batch,
    )


def layout_refusal(
    model: str | os.PathLike,
    *,
    world_size: int,
    layout: Mapping[str, Any] | None = None,
    dtype: str | torch.dtype = "bf16",
    trust_remote_code: bool = False,
) -> str | None:
    """Why the real run would refuse ``layout`` for ``model`` on ``world_size`` ranks, or ``None`` when it fits.

    Rank 0 is simulated as :func:`plan` simulates it (the same build on meta, the same ``parallelize`` or pipeline
    split, so the same checks: heads against TP, experts against EP, layers against PP ...), without the other
    ranks' figures. In this process when it runs no process group (the ``automodel`` command before it starts
    torchrun: no helper process to start, a second or two for a model of any size), else in a forked child.
    """
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES[str(dtype)]
    request = _Request(str(model), world_size, dict(layout or {}), torch_dtype, None, None, "adamw", trust_remote_code)
    if dist.is_available() and dist.is_initialized():
        return simulate_elsewhere(request, 0, classes=False)["error"]
    threads = torch.get_num_threads()
    try:
        return _simulate_here(request, 0, classes=False)["error"]
    finally:
        torch.set_num_threads(threads)


def _pipeline_ranks(classes: list[list[int]], pp_size: int, world_size: int) -> dict[int, list[int]]:
    """Under PP, every pipeline rank's stage group (each holds other stages, so each is simulated) by the classes
    of the first group, shifted into it: the first rank of each class."""
    per_group = world_size // pp_size
    in_group = [[rank for rank in members if rank < per_group] for members in classes]
    in_group = [members for members in in_group if members]
    chosen: dict[int, list[int]] = {}
    for group in range(pp_size):
        offset = group * per_group
        for members in in_group:
            shifted = [offset + rank for rank in members]
            chosen[shifted[0]] = shifted
    return chosen


@dataclass(frozen=True)
class _Request:
    model: str
    world_size: int
    layout: dict[str, Any]
    dtype: torch.dtype
    micro_batch_size: int | None
    seq_len: int | None
    optimizer: str
    trust_remote_code: bool


def _standing_for(figures: RankPlan, members: list[int]) -> RankPlan:
    described = members if len(members) <= 16 else f"{len(members)} ranks: {describe_ranks(members)}"
    return replace(figures, stands_for=described)


def _simulate_here(request: _Request, rank: int, classes: bool) -> dict[str, Any]:
    """What a child process computes for one rank (``planning_processes.simulate_elsewhere``)."""
    torch.set_num_threads(1)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a simulated rank needs a process without a process group")
    start = time.perf_counter()
    target = _Target.resolve(request.model, request.trust_remote_code, request.dtype)
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
class _Target:
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
    def resolve(cls, model: str | os.PathLike, trust_remote_code: bool, dtype: torch.dtype) -> _Target:
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
    classes: list[list[int]] = field(default_factory=list)
    pipeline: dict[str, Any] | None = None


@dataclass
class _Simulation:
    target: _Target
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
        with _fake_process_group(rank, self.world_size), _captured_log() as log:
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
            outcome.log = list(log)
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
        optimizer = sum(local_view(p).numel() for _, p in trainable) * _OPTIMIZER_STATE_BYTES[self.optimizer]
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


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    """The lines the project logs meanwhile (the parallelizer's checklist: rank 0 only)."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("automodel")
    handler, level = _Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
