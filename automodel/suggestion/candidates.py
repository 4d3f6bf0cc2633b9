"""The layouts the search considers, and the pure size rules that drop a layout before anything is built.

A :class:`Candidate` is one way to run a job: the mesh sizes (PP, HSDP replicas, FSDP shards, CP, TP, EP), sequence
parallelism, activation checkpointing, the pipeline schedule, the micro batch and the gradient accumulation. The
rules here are the ones the real run applies to sizes alone (``MeshContext.build``'s ``_validate_layout`` and
``check_pipeline``, the heads / experts / layers checks of ``parallelize`` and the stage split), plus the search's own
choices (TP within a node, HSDP replicas of whole nodes, CP only for long sequences), each stated in ``docs/plan.md``.
None of them builds a model, a mesh or an FSDP unit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .model_facts import ModelFacts

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "CP_MIN_TOKENS",
    "PINNABLE",
    "SCHEDULES",
    "Candidate",
    "Job",
    "Rejections",
    "enumerate_candidates",
]

#: Activation checkpointing modes searched, cheapest in time first.
ACTIVATION_CHECKPOINTING: tuple[bool | str, ...] = (False, "selective", "full")
#: Context parallelism is tried only while each rank keeps at least this many tokens of a sequence ("for long
#: sequences": at 8k tokens or fewer a sequence is never split).
CP_MIN_TOKENS = 8192
#: Pipeline schedules searched: 1F1B with one stage per rank, interleaved 1F1B with two (GPipe holds every
#: microbatch's activations for the same bubble as 1F1B; the zero-bubble schedules are left to the user).
SCHEDULES: tuple[tuple[str, int], ...] = (("1f1b", 1), ("interleaved_1f1b", 2))
#: Layout keys a caller may pin (``layout.tp_size=8`` beside ``--suggest``): the search keeps them fixed.
PINNABLE = (
    "tp_size",
    "pp_size",
    "cp_size",
    "ep_size",
    "dp_replicate_size",
    "sequence_parallel",
    "activation_checkpointing",
    "pp_schedule",
    "pp_virtual_stages",
    "micro_batch_size",
)


@dataclass(frozen=True)
class Job:
    """What is being trained, and on how many ranks: ``global_batch_tokens`` per optimizer step in sequences of
    ``seq_len`` tokens, over ``world_size`` ranks in nodes of ``nproc_per_node``."""

    world_size: int
    nproc_per_node: int
    seq_len: int
    global_batch_tokens: int

    def __post_init__(self) -> None:
        for key in ("world_size", "nproc_per_node", "seq_len", "global_batch_tokens"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}.")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is not a whole number of sequences of seq_len="
                f"{self.seq_len} tokens: give a multiple of {self.seq_len}."
            )

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step (the recipe's ``train.global_batch_size``)."""
        return self.global_batch_tokens // self.seq_len


@dataclass(frozen=True)
class Candidate:
    """One layout with its micro batch: mesh sizes (``pp x dp_replicate x dp_shard x cp x tp`` = the world size; EP
    over the ranks of a stage group), the modifiers, and ``accumulation``: micro batches per step on each data-parallel
    rank (a pipeline's microbatches)."""

    pp_size: int
    dp_replicate_size: int
    dp_shard_size: int
    cp_size: int
    tp_size: int
    ep_size: int
    sequence_parallel: bool
    activation_checkpointing: bool | str
    pp_schedule: str
    pp_virtual_stages: int
    micro_batch_size: int
    accumulation: int
    grad_sync: str = "step"

    @property
    def world_size(self) -> int:
        """Every rank of the job."""
        return self.pp_size * self.stage_world

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage group (all ranks without PP)."""
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

    @property
    def dp_size(self) -> int:
        """Ranks that see different sequences: ``dp_replicate x dp_shard``."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def fsdp_size(self) -> int:
        """The ranks FSDP2 shards a dense unit over: ``dp_shard x cp``."""
        return self.dp_shard_size * self.cp_size

    @property
    def ep_shard_size(self) -> int:
        """The ranks FSDP2 shards an expert-parallel unit over (the stage group's ranks over ``ep``)."""
        return self.stage_world // self.ep_size

    @property
    def structure(self) -> tuple:
        """The sizes and schedule: what decides each rank's shards (the same for every modifier and micro batch)."""
        return (
            self.pp_size,
            self.dp_replicate_size,
            self.cp_size,
            self.tp_size,
            self.ep_size,
            self.pp_schedule if self.pp_size > 1 else None,
            self.pp_virtual_stages,
        )

    @property
    def shape(self) -> tuple:
        """The structure less the HSDP replica count: the suggestions list one layout per shape (the best
        replica count of it), so that they differ in how the model is split, not only in where gradients meet."""
        return tuple(value for index, value in enumerate(self.structure) if index != 1)

    @property
    def plan_key(self) -> tuple:
        """What one real plan answers for: the world size, the structure and the modifiers a model may refuse."""
        return (self.world_size, *self.structure, self.sequence_parallel, self.activation_checkpointing)

    def layout(self) -> dict[str, Any]:
        """``MeshContext.build`` keywords (those not at their defaults), the pipeline's microbatches included."""
        layout: dict[str, Any] = {}
        for key in ("dp_replicate_size", "tp_size", "cp_size", "ep_size"):
            if getattr(self, key) != 1:
                layout[key] = getattr(self, key)
        if self.sequence_parallel:
            layout["sequence_parallel"] = True
        if self.activation_checkpointing:
            layout["activation_checkpointing"] = self.activation_checkpointing
        if self.pp_size > 1:
            layout.update(
                pp_size=self.pp_size,
                pp_schedule=self.pp_schedule,
                pp_virtual_stages=self.pp_virtual_stages,
                pp_microbatches=self.accumulation,
            )
        return layout

    def recipe_overrides(self, job: Job) -> list[str]:
        """The ``key=value`` overrides that run this layout with a recipe (``automodel sft --config ... KEYS``)."""
        layout = {key: value for key, value in self.layout().items() if key != "pp_microbatches"}
        if layout.get("pp_virtual_stages") == 1:
            del layout["pp_virtual_stages"]
        keys = [f"layout.{key}={_yaml(value)}" for key, value in layout.items()]
        keys += [
            f"train.micro_batch_size={self.micro_batch_size}",
            f"train.global_batch_size={job.sequences}",
            f"train.seq_len={job.seq_len}",
        ]
        if self.grad_sync != "step":
            keys.append(f"train.grad_sync={self.grad_sync}")
        return keys

    def describe(self) -> str:
        """A short name: ``pp4 x fsdp16 x tp8, sp, ac=selective, micro batch 1 x 8``."""
        axes = [
            f"{name}{size}"
            for name, size in (
                ("pp", self.pp_size),
                ("hsdp", self.dp_replicate_size),
                ("fsdp", self.dp_shard_size),
                ("cp", self.cp_size),
                ("tp", self.tp_size),
                ("ep", self.ep_size),
            )
            if size > 1 or name == "fsdp"
        ]
        parts = [" x ".join(axes)]
        if self.pp_size > 1:
            parts.append(self.pp_schedule + (f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""))
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"ac={self.activation_checkpointing or 'off'}")
        parts.append(f"micro batch {self.micro_batch_size} x {self.accumulation}")
        if self.grad_sync != "step":
            parts.append(f"grad_sync={self.grad_sync}")
        return ", ".join(parts)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


@dataclass
class Rejections:
    """Why layouts were dropped by the size rules: one line per rule and value, with how often it applied."""

    counts: dict[str, int]

    def add(self, reason: str) -> None:
        """Count one application of the rule ``reason``."""
        self.counts[reason] = self.counts.get(reason, 0) + 1


def enumerate_candidates(
    facts: ModelFacts, job: Job, pins: Mapping[str, Any] | None = None
) -> tuple[list[Candidate], Rejections]:
    """Every candidate the size rules allow for ``facts`` on ``job``, and what the rules dropped (one line per rule
    and value). ``pins`` fixes layout keys (:data:`PINNABLE`)."""
    pins = dict(pins or {})
    unknown = sorted(set(pins) - set(PINNABLE))
    if unknown:
        raise ValueError(f"{unknown} cannot be pinned in a layout search: pin any of {list(PINNABLE)}.")
    rejected = Rejections({})
    candidates = list(_walk(facts, job, pins, rejected))
    return candidates, rejected


def _allowed(key: str, values: list, pins: dict[str, Any]) -> list:
    """``values``, or the pinned value alone (whether or not it is among them: the rules then say why not)."""
    if key not in pins:
        return values
    pinned = pins[key]
    return ["full" if key == "activation_checkpointing" and pinned is True else pinned]


def _divides(key: str, size: Any, ranks: int, what: str, rejected: Rejections) -> bool:
    if isinstance(size, int) and size >= 1 and ranks % size == 0:
        return True
    rejected.add(f"{key}={size}: does not divide the {ranks} {what}")
    return False


def _walk(facts: ModelFacts, job: Job, pins: dict[str, Any], rejected: Rejections) -> Iterator[Candidate]:
    world, node = job.world_size, job.nproc_per_node
    for pp in _allowed("pp_size", _divisors(world), pins):
        if not _divides("pp_size", pp, world, "ranks", rejected):
            continue
        if pp > 1 and (why := _pipeline_rule(facts, pp)):
            rejected.add(why)
            continue
        for tp in _allowed("tp_size", _divisors(world // pp), pins):
            if not _divides("tp_size", tp, world // pp, "ranks of a pipeline stage group", rejected):
                continue
            if why := _tp_rule(facts, tp, node):
                rejected.add(why)
                continue
            for cp in _allowed("cp_size", _divisors(world // (pp * tp)), pins):
                if not _divides("cp_size", cp, world // (pp * tp), "ranks left by pp_size x tp_size", rejected):
                    continue
                if why := _cp_rule(job.seq_len, cp, pp):
                    rejected.add(why)
                    continue
                yield from _replicas(facts, job, pins, rejected, pp, tp, cp)


def _replicas(facts, job, pins, rejected, pp: int, tp: int, cp: int) -> Iterator[Candidate]:
    stage_world = job.world_size // pp
    for replicas in _allowed("dp_replicate_size", _divisors(stage_world // (tp * cp)), pins):
        if not _divides("dp_replicate_size", replicas, stage_world // (tp * cp), "data-parallel ranks", rejected):
            continue
        if replicas > 1 and (stage_world // replicas) % job.nproc_per_node:
            rejected.add(
                f"dp_replicate_size={replicas}: an HSDP replica of {stage_world // replicas} ranks is not whole nodes "
                f"of {job.nproc_per_node} (replicas are searched across nodes only)"
            )
            continue
        shard = stage_world // (replicas * tp * cp)
        replica = shard * cp * tp
        for ep in _allowed("ep_size", [1, *_divisors(replica)[1:]] if facts.experts else [1], pins):
            if not _divides("ep_size", ep, replica, "ranks of a data-parallel replica (dp_shard x cp x tp)", rejected):
                continue
            if ep > 1 and (why := _ep_rule(facts, ep, tp)):
                rejected.add(why)
                continue
            dp = replicas * shard
            if job.sequences % dp:
                rejected.add(
                    f"{dp} data-parallel ranks do not divide the global batch of {job.sequences} sequences "
                    "(--global-batch-tokens / --seq-len)"
                )
                continue
            for schedule, virtual in _schedules(facts, pp, pins, rejected):
                sizes = (pp, replicas, shard, cp, tp, ep, schedule, virtual)
                yield from _modifiers(job, pins, rejected, sizes)


def _schedules(facts: ModelFacts, pp: int, pins, rejected: Rejections) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule, virtual in SCHEDULES:
        if pins.get("pp_schedule", schedule) != schedule or pins.get("pp_virtual_stages", virtual) != virtual:
            continue
        if facts.num_layers < pp * virtual:
            rejected.add(
                f"pp_size={pp} with {schedule} x {virtual}: {pp * virtual} stages for {facts.num_layers} decoder layers"
            )
            continue
        yield schedule, virtual


def _modifiers(job: Job, pins, rejected: Rejections, sizes: tuple) -> Iterator[Candidate]:
    pp, replicas, shard, cp, tp, ep, schedule, virtual = sizes
    rows = job.sequences // (replicas * shard)
    for micro in _allowed("micro_batch_size", _divisors(rows), pins):
        if not isinstance(micro, int) or micro < 1 or rows % micro:
            rejected.add(f"micro_batch_size={micro} does not divide the {rows} sequences per data-parallel rank")
            continue
        accumulation = rows // micro
        if pp > 1 and accumulation < pp:
            rejected.add(f"pp_size={pp}: fewer microbatches ({accumulation}) than pipeline ranks")
            continue
        syncs = ("step", "micro_batch") if pp == 1 and accumulation > 1 else ("step",)
        for mode in _allowed("activation_checkpointing", list(ACTIVATION_CHECKPOINTING), pins):
            if mode not in ACTIVATION_CHECKPOINTING:
                rejected.add(f"activation_checkpointing={mode!r}: not a mode (False, 'selective', 'full')")
                continue
            for sequence_parallel in _allowed("sequence_parallel", [True, False] if tp > 1 else [False], pins):
                if sequence_parallel and tp == 1:
                    rejected.add("sequence_parallel=true: it shards activations over TP ranks, and tp_size=1")
                    continue
                for grad_sync in syncs:
                    yield Candidate(
                        pp, replicas, shard, cp, tp, ep, sequence_parallel, mode, schedule, virtual, micro,
                        accumulation, grad_sync,
                    )  # fmt: skip


def _pipeline_rule(facts: ModelFacts, pp: int) -> str | None:
    if facts.pipeline_refusal is not None:
        return f"pp_size>1: {facts.pipeline_refusal}"
    if facts.num_layers < pp:
        return f"pp_size={pp}: more pipeline ranks than the {facts.num_layers} decoder layers"
    return None


def _tp_rule(facts: ModelFacts, tp: int, node: int) -> str | None:
    if tp == 1:
        return None
    if node % tp:
        return f"tp_size={tp}: TP is searched within a node, and {tp} does not divide the {node} ranks of a node"
    for label, count in facts.heads.items():
        if count % tp:
            return f"tp_size={tp}: does not divide {label}={count}"
    return None


def _cp_rule(seq_len: int, cp: int, pp: int) -> str | None:
    if cp == 1:
        return None
    if pp > 1:
        return f"cp_size={cp}: context parallelism does not run with a pipeline (pp_size={pp})"
    if seq_len % (2 * cp):
        return f"cp_size={cp}: seq_len={seq_len} is not a multiple of 2 x cp_size"
    if seq_len // cp < CP_MIN_TOKENS:
        return f"cp_size={cp}: each rank would keep {seq_len // cp} tokens, fewer than {CP_MIN_TOKENS} (CP is for long sequences)"
    return None


def _ep_rule(facts: ModelFacts, ep: int, tp: int) -> str | None:
    if not facts.experts:
        return f"ep_size={ep}: {facts.name} has no routed experts in an expert-parallel plan"
    if facts.experts % ep:
        return f"ep_size={ep}: does not divide the {facts.experts} experts"
    if ep % tp:
        return f"ep_size={ep}: not a multiple of tp_size={tp}"
    return None
