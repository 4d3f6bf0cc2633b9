"""``automodel.suggest``: the fastest layouts that fit, from exact per-rank memory and the cost model.

The search runs in three passes, each cheaper than the next:

1. the size rules (:mod:`.candidates`) enumerate the layouts the real run could take, from the model's facts alone;
2. the memory bound (:meth:`.memory.MemoryModel.bound`, never above the exact figure) drops every layout that
   cannot fit, and the cost model (:mod:`.cost_model`) orders the rest by estimated step time;
3. in that order, the real planner (``automodel.plan``: the build on meta and ``parallelize`` under a fake process
   group) plans the worst rank of each pipeline stage group of each layout, until ``top`` distinct layouts are
   accepted by it and fit by its exact figures. One plan serves every micro batch and gradient-sync choice of a
   layout.

A layout the rules drop never costs a ``fully_shard``; only the survivors nearest the top are planned.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .candidates import PINNABLE, Candidate, Job, enumerate_candidates
from .cost_model import CostModel, StepTime
from .hardware import GPUS, Hardware
from .memory import HEADROOM, MemoryModel, MemoryParts, Training, usable_bytes
from .model_facts import ModelFacts, model_facts
from .report import Suggestion, Suggestions, every_plan_refused

__all__ = ["DEFAULT_SEQ_LEN", "MAX_PLANS", "LayoutMemory", "layout_memory", "load_facts", "suggest", "training_setup"]

#: Sequence length when none is given (torchtitan's Llama 3 configs train on 8,192 tokens).
DEFAULT_SEQ_LEN = 8192
#: The most layouts one search plans exactly; past it, the search reports what it has found and says so.
MAX_PLANS = 48
#: World sizes tried when nothing fits: up to this many times the requested one.
LARGEST_WORLD_FACTOR = 64


def training_setup(
    layout: Mapping[str, Any], dtype: str | torch.dtype = "bf16", optimizer: str = "adamw", trainable: bool = True
) -> Training:
    """The element sizes and options of training with ``layout`` (``MeshContext.build`` keywords: its strategy's
    mixed precision and resharding), weights in ``dtype``, ``optimizer``'s states."""
    from automodel.planning_simulation import OPTIMIZER_STATES  # the plan's count: the search agrees with it

    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(OPTIMIZER_STATES)}.")
    load = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(load, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: use bf16 or fp32.")
    strategy = layout.get("strategy", "fsdp2")
    compute = getattr(strategy, "param_dtype", None) or load
    reduce = getattr(strategy, "reduce_dtype", None) or compute
    size = lambda kind: torch.empty(0, dtype=kind).element_size()  # noqa: E731
    return Training(
        param_bytes=size(load),
        compute_bytes=size(compute),
        reduce_bytes=size(reduce),
        optimizer_bytes=OPTIMIZER_STATES[optimizer] * size(load),
        trainable=trainable,
        keep_unsharded=getattr(strategy, "reshard_after_forward", None) is False,
    )


@dataclass
class _Search:
    """One search's state: the model, the machine, what is pinned, and the plans made so far."""

    model: str
    facts: ModelFacts
    hardware: Hardware
    base_layout: dict[str, Any]
    pins: dict[str, Any]
    dtype: str | torch.dtype
    optimizer: str
    trust_remote_code: bool
    training: Training
    usable: int
    workers: int = 2
    plans: dict[tuple, Future] = field(default_factory=dict)
    shapes: dict[tuple, tuple] = field(default_factory=dict)  # plan key -> shape
    refusals: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    memory: MemoryModel | None = None

    def count(self, key: str, number: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + number

    def survivors(self, job: Job) -> tuple[list[tuple[float, MemoryParts, StepTime, Candidate]], MemoryParts | None]:
        """Pass 1 and 2 for ``job``: the candidates whose bound fits, fastest first, and the smallest bound of all
        (what the least hungry layout needs)."""
        candidates, rejections = enumerate_candidates(self.facts, job, self.pins)
        self.count("layouts", len(candidates))
        self.rejections = rejections.counts
        memory = MemoryModel(self.facts, self.training, job.seq_len)
        cost = CostModel(memory, self.hardware)
        kept, least = [], None
        for candidate in candidates:
            bound = memory.bound(candidate)
            if least is None or bound.peak < least[0].peak:
                least = (bound, candidate)
            if bound.peak > self.usable:
                self.count("over_bound")
                continue
            time_parts = cost.step_time(candidate)
            kept.append((time_parts.total, bound, time_parts, candidate))
        kept.sort(key=lambda item: (item[0], item[1].peak))
        self.memory = memory
        return kept, least

    def plan_figures(self, candidate: Candidate, pool: ThreadPoolExecutor) -> Future:
        """The real plan of the first rank of a pipeline stage group of each kind (the worst of its group: it holds
        the ceil chunks, and FSDP2 pads the others to it; stage groups of one kind hold the same modules), once per
        :attr:`Candidate.plan_key`."""
        if candidate.plan_key not in self.plans:
            self.count("planned")
            self.shapes[candidate.plan_key] = candidate.shape
            self.plans[candidate.plan_key] = pool.submit(self._plan, candidate)
        return self.plans[candidate.plan_key]

    def _plan(self, candidate: Candidate):
        from automodel.planning import plan

        ranks = [group * candidate.stage_world for group in self.memory.representatives(candidate)]
        return plan(
            self.model,
            world_size=candidate.world_size,
            layout={**self.base_layout, **candidate.layout()},
            ranks=ranks,
            dtype=self.dtype,
            optimizer=self.optimizer,
            trust_remote_code=self.trust_remote_code,
        )

    def exact(self, ordered, job: Job, top: int, pool: ThreadPoolExecutor) -> list[Suggestion]:
        """Pass 3: plan the survivors in order until ``top`` distinct layouts fit (two plans at a time ahead)."""
        accepted: dict[tuple, Suggestion] = {}
        for index, (_, _, time_parts, candidate) in enumerate(ordered):
            if len(accepted) >= top or self.counts.get("planned", 0) > MAX_PLANS:
                break
            if candidate.shape in accepted:
                continue
            self._plan_ahead(ordered, index, accepted, pool)
            result = self.plan_figures(candidate, pool).result()
            if not result.ok:
                self.count("refused")
                self.refusals.setdefault(result.error, candidate.describe())
                continue
            statics = {rank.rank // candidate.stage_world: rank.to_dict() for rank in result.ranks}
            parts = self.memory.exact(candidate, statics)
            if parts.peak > self.usable:
                self.count("over_exact")
                continue
            accepted[candidate.shape] = Suggestion(candidate, parts, time_parts, self.usable, job)
        return list(accepted.values())

    def _plan_ahead(self, ordered, index: int, accepted, pool: ThreadPoolExecutor) -> None:
        """Start the plans of the next layouts while a worker is free: one per shape not yet planned (a second
        layout of a shape is planned only once the first one failed)."""
        pending = sum(1 for future in self.plans.values() if not future.done())
        planned = set(self.shapes.values())
        for _, _, _, candidate in ordered[index : index + 64]:
            if pending >= self.workers:
                return
            if candidate.shape in accepted or candidate.shape in planned or candidate.plan_key in self.plans:
                continue
            self.plan_figures(candidate, pool)
            planned.add(candidate.shape)
            pending += 1


def suggest(
    model: str | os.PathLike,
    *,
    world_size: int,
    gpu: str | Hardware = "h100",
    gpu_memory: int | None = None,
    nproc_per_node: int | None = None,
    seq_len: int = DEFAULT_SEQ_LEN,
    global_batch_tokens: int | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    layout: Mapping[str, Any] | None = None,
    pins: Mapping[str, Any] | None = None,
    dtype: str | torch.dtype = "bf16",
    optimizer: str = "adamw",
    trainable: bool = True,
    top: int = 5,
    headroom: float = HEADROOM,
    trust_remote_code: bool = False,
) -> Suggestions:
    """The ``top`` fastest layouts (by the cost model of ``docs/plan.md``) of ``model`` on ``world_size`` ranks that
    the real run accepts and whose exact per-rank peak fits ``gpu_memory`` (bytes; default ``gpu``'s) less
    ``headroom``. ``layout`` holds the ``MeshContext.build`` keywords the search keeps (strategy, mixed precision);
    ``pins`` the searched keys to keep fixed (``tp_size``, ``activation_checkpointing``, ``micro_batch_size`` ...).
    ``global_batch_tokens`` defaults to one sequence of ``seq_len`` per rank. When nothing fits, the result says why
    and the smallest world size (in whole nodes) where something does."""
    start = time.perf_counter()
    if isinstance(gpu, str) and gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r}: choose one of {sorted(GPUS)}, or give gpu_memory.")
    hardware = GPUS[gpu] if isinstance(gpu, str) else gpu
    hardware = hardware.with_options(
        memory_bytes=gpu_memory,
        intra_node_gbps=intra_node_gbps,
        inter_node_gbps=inter_node_gbps,
        nproc_per_node=nproc_per_node,
    )
    if top < 1:
        raise ValueError(f"top={top!r}: ask for at least one layout.")
    pins = dict(pins or {})
    base = {key: value for key, value in dict(layout or {}).items() if key not in PINNABLE}
    if getattr(base.get("strategy", "fsdp2"), "name", base.get("strategy", "fsdp2")) != "fsdp2":
        raise ValueError("The layout search runs FSDP2 layouts: set layout.strategy=fsdp2 (the default).")
    facts = load_facts(model, trust_remote_code, dtype)
    search = _Search(
        str(model), facts, hardware, base, pins, dtype, optimizer, trust_remote_code,
        training_setup(base, dtype, optimizer, trainable), usable_bytes(hardware.memory_bytes, headroom),
    )  # fmt: skip
    search.workers = max(1, min(os.cpu_count() or 1, 4))
    job = _job(world_size, hardware, seq_len, global_batch_tokens)
    ordered, least = search.survivors(job)
    with ThreadPoolExecutor(max_workers=search.workers) as pool:
        found = search.exact(ordered, job, top, pool)
        for future in search.plans.values():
            future.cancel()
    smallest = None
    # A larger world helps a layout that needs more memory, not one the model refuses (a pinned key it cannot take).
    if not found and not (least is not None and every_plan_refused(search.counts, least[0].peak, search.usable)):
        smallest = _smallest_world(search, job, global_batch_tokens)
    return Suggestions(
        model=str(model),
        facts=facts,
        job=job,
        hardware=hardware,
        usable_bytes=search.usable,
        headroom=headroom,
        suggestions=found,
        counts=dict(search.counts),
        rejections=dict(search.rejections),
        refusals=dict(search.refusals),
        least=least,
        smallest_world_size=smallest,
        seconds=time.perf_counter() - start,
        stopped_early=search.counts.get("planned", 0) > MAX_PLANS and len(found) < top,
    )


@dataclass(frozen=True)
class LayoutMemory:
    """One given layout's verdict: ``error`` (the real run's refusal, or ``None``), its worst rank's ``memory``
    (``None`` when refused) and what it may use (``usable_bytes``)."""

    error: str | None
    memory: MemoryParts | None
    usable_bytes: int

    @property
    def fits(self) -> bool:
        """Accepted by the real run, and its peak within the usable memory."""
        return self.error is None and self.memory is not None and self.memory.peak <= self.usable_bytes


def layout_memory(
    model: str | os.PathLike,
    candidate: Candidate,
    *,
    seq_len: int,
    memory_bytes: int,
    layout: Mapping[str, Any] | None = None,
    dtype: str | torch.dtype = "bf16",
    optimizer: str = "adamw",
    trainable: bool = True,
    headroom: float = HEADROOM,
    trust_remote_code: bool = False,
) -> LayoutMemory:
    """The exact per-rank peak of ``candidate`` (one layout with its micro batch) for ``model``: the real plan of
    the first rank of each kind of pipeline stage group, plus the activation estimate and what a step holds
    unsharded, against ``memory_bytes`` less ``headroom`` (what ``automodel sft`` checks before launch)."""
    base = {key: value for key, value in dict(layout or {}).items() if key not in PINNABLE}
    facts = load_facts(model, trust_remote_code, dtype)
    training = training_setup(base, dtype, optimizer, trainable)
    search = _Search(
        str(model), facts, GPUS["h100"], base, {}, dtype, optimizer, trust_remote_code, training,
        usable_bytes(memory_bytes, headroom), workers=1, memory=MemoryModel(facts, training, seq_len),
    )  # fmt: skip
    with ThreadPoolExecutor(max_workers=1) as pool:
        result = search.plan_figures(candidate, pool).result()
    if not result.ok:
        return LayoutMemory(result.error, None, search.usable)
    statics = {rank.rank // candidate.stage_world: rank.to_dict() for rank in result.ranks}
    return LayoutMemory(None, search.memory.exact(candidate, statics), search.usable)


def load_facts(model: str | os.PathLike, trust_remote_code: bool, dtype: str | torch.dtype) -> ModelFacts:
    """The :class:`ModelFacts` of ``model`` (a local folder or a hub id: its config), built on the meta device."""
    from automodel.planning_simulation import DTYPES, Target

    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype))
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}.")
    target = Target.resolve(model, trust_remote_code, torch_dtype)
    return model_facts(target.build())


def _job(world_size: int, hardware: Hardware, seq_len: int, global_batch_tokens: int | None) -> Job:
    node = min(hardware.nproc_per_node, world_size)
    return Job(world_size, node, seq_len, global_batch_tokens or world_size * seq_len)


def _smallest_world(search: _Search, job: Job, global_batch_tokens: int | None) -> int | None:
    """The smallest world size above ``job``'s (every size up to a node, then whole nodes) where a layout fits: by
    the bound first, then by the real plan of the fastest layouts that pass it."""
    node, limit = search.hardware.nproc_per_node, LARGEST_WORLD_FACTOR * job.world_size
    sizes = list(range(job.world_size + 1, node + 1))
    sizes += [node * nodes for nodes in range(job.world_size // node + 1, limit // node + 1)]
    counts, rejections, refusals = dict(search.counts), search.rejections, dict(search.refusals)
    try:
        for size in (size for size in sizes if job.world_size < size <= limit):
            larger = _job(size, search.hardware, job.seq_len, global_batch_tokens)
            ordered, _ = search.survivors(larger)
            if not ordered:
                continue
            with ThreadPoolExecutor(max_workers=search.workers) as pool:
                if search.exact(ordered, larger, 1, pool):
                    return size
        return None
    finally:
        search.counts, search.rejections, search.refusals = counts, rejections, refusals
