"""``ParallelPlan``: every decision ``parallelize`` makes for one model and one ``MeshContext``, frozen before the model
is touched (:func:`automodel.distributed.planner.plan_parallelization` makes it; :func:`automodel.distributed.apply.
apply_plan` carries it out).

Modules are named, not held: a plan is plain data, printable (:meth:`ParallelPlan.describe`, the lines rank 0 logs)
and serializable (:meth:`ParallelPlan.to_dict`, what ``automodel plan --json`` prints).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "CheckpointingPlan",
    "CompilePlan",
    "ContextParallelPlan",
    "ExpertParallelPlan",
    "ParallelPlan",
    "ShardingPlan",
    "TensorParallelPlan",
    "TrainabilityPlan",
]

#: ``reshard_after_forward`` as the FSDP2 line says it.
_RESHARD_POLICY = {None: "all but the last layer and the head", True: "always", False: "never"}


@dataclass(frozen=True)
class TensorParallelPlan:
    """TP over ``size`` ranks: the plan's rules (transformers style names by module or parameter name, ``*`` for
    layer numbers; the routed experts' dropped under EP), where they came from, sequence parallelism, and the style
    each LoRA adapter takes from its base layer."""

    size: int
    rules: dict[str, str]
    source: str  # "from_pretrained(tp_plan=...)", the sidecar's class name, "the model", "derived from the module tree"
    derived: bool
    sequence_parallel: bool
    adapter_rules: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        source = self.source if self.derived else f"from {self.source}"
        return f"TP over tp={self.size} (plan: {len(self.rules)} rules {source}{sp})"


@dataclass(frozen=True)
class ExpertParallelPlan:
    """EP over ``size`` ranks: the routed-experts modules it splits (twins sharing them included)."""

    size: int
    experts: tuple[str, ...]

    def describe(self) -> str:
        return f"EP over ep={self.size}: {len(self.experts)} experts modules"


@dataclass(frozen=True)
class ContextParallelPlan:
    """CP over ``size`` ranks: attention of ``blocks`` decoder blocks through the context-parallel kernel."""

    size: int
    blocks: int

    def describe(self) -> str:
        return f"CP over cp={self.size} on {self.blocks} blocks"


@dataclass(frozen=True)
class CheckpointingPlan:
    """Activation checkpointing: its mode, the checkpointed modules (whole blocks with ``full_layers``, else the
    blocks' attention / MLP ...), and whether MoE routing decisions are replayed."""

    mode: str  # "full" or "selective"
    targets: tuple[str, ...]
    full_layers: bool
    blocks: int
    replay_routing: bool

    def describe(self) -> str:
        unit = "whole blocks" if self.full_layers else f"modules of {self.blocks} blocks"
        return f"AC {self.mode} on {len(self.targets)} {unit}"


@dataclass(frozen=True)
class CompilePlan:
    """Whether decoder blocks are compiled (and why), and how many."""

    enabled: bool
    why: str
    blocks: int

    def describe(self) -> str:
        if not self.enabled:
            return f"compile: off ({self.why})"
        return f"compile: on ({self.why}), {self.blocks} blocks (compiled at the first forward)"


@dataclass(frozen=True)
class TrainabilityPlan:
    """Which parameters stay trainable: as before parallelization (``requires_grad`` by name), then the context's
    ``reapply_trainability`` callback if any (its effect is known only once it has run)."""

    frozen: tuple[str, ...]
    trainable_elements: int
    total_elements: int
    trainable_tensors: int
    total_tensors: int
    reapply: bool

    def describe(self) -> str | None:
        if not self.reapply and not self.frozen:
            return None
        return self.line("reapply_trainability" if self.reapply else "as before parallelization")

    def line(self, source: str) -> str:
        """The log line for these counts (after ``reapply_trainability``, apply counts again)."""
        return (
            f"trainability ({source}): {self.trainable_elements:,} of {self.total_elements:,} parameters trainable "
            f"({self.trainable_tensors} of {self.total_tensors} tensors)"
        )


@dataclass(frozen=True)
class ShardingPlan:
    """How the model is wrapped: ``kind`` ``"fsdp2"`` (units over ``mesh``; under EP the experts first over
    ``ep_shard``), ``"ddp"`` or ``"megatron_fsdp"``.

    FSDP2 ``units`` are the default units' kinds (``"layers"``, ``"embeddings"``, ``"head"``, ``"encoder blocks"``
    or a module class) with their counts, or ``None`` where a sidecar's hook shapes them (``units_source``); the FSDP2
    line then is the one counted on the sharded model."""

    kind: str
    mesh: dict[str, int]
    units: dict[str, int] | None = None
    units_source: str = "the shared default units"
    experts_over: int | None = None  # ep_shard size, under EP
    expert_units: int = 0
    reshard_after_forward: bool | None = None
    prefetch: bool = False
    primitive: str = "fully_shard"

    def describe(self) -> str | None:
        if self.kind == "ddp":
            return f"DDP over dp={self.mesh['dp']}"
        if self.kind == "megatron_fsdp":
            return f"Megatron-FSDP over dp_shard_cp={self.mesh['dp_shard_cp']}"
        if self.units is None:
            return None
        return self.fsdp_line(self.units)

    def fsdp_line(self, units: dict[str, int]) -> str | None:
        """``"FSDP2 units: 4 experts over ep_shard=2; 24 layers + embeddings + head + root over dp_shard_cp=4; ..."``
        for these unit counts (``None``: nothing is sharded)."""
        if not units and not self.expert_units:
            return None
        parts = [f"{count} {kind}" if count > 1 or kind == "layers" else kind for kind, count in units.items() if count]
        over = ", ".join(f"{name}={size}" for name, size in self.mesh.items())
        line = " + ".join([*parts, "root"]) + f" over {over}"
        if self.experts_over is not None:
            line = f"{self.expert_units} experts over ep_shard={self.experts_over}; {line}"
        line += f"; reshard after forward: {_RESHARD_POLICY[self.reshard_after_forward]}"
        return f"FSDP2 units: {line}" + ("; layers prefetch" if self.prefetch else "")


@dataclass(frozen=True)
class ParallelPlan:
    """Every decision for one model on one ``MeshContext``: the path, then one entry per step in the order
    :func:`~automodel.distributed.apply.apply_plan` takes them (TP -> EP -> CP -> AC -> compile -> trainability ->
    shard); ``None`` for a step that does nothing. ``notes`` are what the hook checks say (a hook that does not apply
    on this path); ``structure`` the decoder blocks found (and how)."""

    model: str
    parallelizer: str
    path: str
    decoder_blocks: tuple[str, ...]
    tp: TensorParallelPlan | None
    ep: ExpertParallelPlan | None
    cp: ContextParallelPlan | None
    ac: CheckpointingPlan | None
    compile: CompilePlan
    trainability: TrainabilityPlan
    sharding: ShardingPlan
    notes: tuple[str, ...] = ()

    def steps(self, *, trainability: str | None = None, sharding: str | None = None) -> list[str]:
        """The lines of the steps (what rank 0 logs after the model is parallelized); ``trainability`` and
        ``sharding`` replace the plan's own lines where only the applied model can say (after a
        ``reapply_trainability`` callback; units a sidecar's hook shaped)."""
        lines = [
            self.tp.describe() if self.tp else None,
            self.ep.describe() if self.ep else None,
            self.cp.describe() if self.cp else None,
            self.ac.describe() if self.ac else None,
            self.compile.describe(),
            trainability or self.trainability.describe(),
            sharding or self.sharding.describe(),
        ]
        return [line for line in lines if line]

    def describe(self) -> list[str]:
        """The lines rank 0 logs for this plan, in order: the hook notes, the path, then one line per step that does
        something."""
        return [*self.notes, f"Parallelizing {self.model} with {self.parallelizer} on {self.path}", *self.steps()]

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``automodel plan --json``)."""
        return asdict(self)
