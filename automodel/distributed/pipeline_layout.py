"""The pipeline-parallel part of a layout: the ``pp`` axis (outermost), the schedule, microbatches and virtual stages.

``MeshContext.build(pp_size=P, ...)`` checks it with :func:`check_pipeline` and keeps it as
``MeshContext.pipeline``; the dense axes of the context are then those of this rank's stage (``world_size / P``
ranks), so that every stage goes through the same ``parallelize(stage, context)`` as a model without PP. torch's
``torch.distributed.pipelining`` runs the schedules (:mod:`automodel.distributed.pipelined_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from .config import DDPConfig, MegatronFSDPConfig, StrategyConfig

__all__ = [
    "PIPELINE_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "PipelineLayout",
    "check_pipeline",
    "ideal_bubble",
    "in_flight_microbatches",
]

#: Schedule names and whether each runs several (virtual) stages per rank.
PIPELINE_SCHEDULES: dict[str, bool] = {
    "gpipe": False,
    "1f1b": False,
    "interleaved_1f1b": True,
    "interleaved_zero_bubble": True,
    "zbv": True,
}
#: Schedules whose ranks hold their stages in a V (rank ``r``: stages ``r`` and ``2P - 1 - r``: the first and the
#: last stage on rank 0), with exactly two stages per rank; the others place stages in a loop (``r, r + P, ...``).
V_SHAPED_SCHEDULES = frozenset({"zbv"})
#: Schedules that split each backward into its input-gradient and its weight-gradient pass (torch's zero-bubble
#: schedules), running the weight passes where the others idle.
ZERO_BUBBLE_SCHEDULES = frozenset({"interleaved_zero_bubble", "zbv"})
#: Schedules that run the microbatches in rounds of ``pp_size`` (torch's ``ScheduleInterleaved1F1B`` and
#: ``ScheduleInterleavedZeroBubble``): the number of microbatches must be a multiple of ``max(1, M // pp_size)``.
ROUND_SCHEDULES = frozenset({"interleaved_1f1b", "interleaved_zero_bubble"})


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in the pipeline: the 1-D ``pp`` mesh through it (one rank of each stage group), the
    schedule, the microbatches per step and the stages per rank (``virtual_stages``; rank ``r`` holds stages
    ``r, r + P, r + 2P ...``)."""

    mesh: DeviceMesh
    schedule: str
    microbatches: int
    virtual_stages: int = 1

    @property
    def size(self) -> int:
        """Pipeline ranks (``pp_size``)."""
        return self.mesh.size()

    @property
    def rank(self) -> int:
        """This rank's coordinate on the ``pp`` axis."""
        return self.mesh.get_local_rank()

    @property
    def num_stages(self) -> int:
        """All stages of the model: ``pp_size * virtual_stages``."""
        return self.size * self.virtual_stages

    @property
    def local_stages(self) -> list[int]:
        """The stage indices this rank runs, in order."""
        return [stage for stage in range(self.num_stages) if self.stage_rank(stage) == self.rank]

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``: in a loop (``stage % P``), or in a V for the V-shaped schedules."""
        if self.schedule in V_SHAPED_SCHEDULES:
            return stage if stage < self.size else 2 * self.size - 1 - stage
        return stage % self.size

    def ideal_bubble(self) -> float:
        """The idle share of a step with equal stages and free communication: ``(P - 1) / (M + P - 1)`` for GPipe
        and 1F1B; ``V`` stages per rank (interleaved 1F1B) shrink it to ``(P - 1) / (V M + P - 1)``; the zero-bubble
        schedules fill the cool-down with the weight-gradient passes, which leaves ``(P - 1) / (3 V M + P - 1)``
        with a forward, an input-gradient and a weight-gradient pass of equal cost (Qi et al.'s ZB-H1 bound; ZB-V
        can do better)."""
        return ideal_bubble(self.schedule, self.size, self.microbatches, self.virtual_stages)

    def in_flight(self, rank: int | None = None) -> float:
        """The most microbatches whose activations pipeline rank ``rank`` (default: this one) holds at once, in
        units of all of its stages' layers: GPipe runs every forward before any backward (``M``); 1F1B starts at
        most ``P - r`` forwards ahead of its backwards; interleaved 1F1B warms up ``(V - 1) P + 2 (P - 1 - r) + 1``
        stage passes of ``1 / V`` of the rank's layers each (torch's schedule)."""
        return in_flight_microbatches(
            self.schedule, self.size, self.microbatches, self.virtual_stages, self.rank if rank is None else rank
        )


def ideal_bubble(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """:meth:`PipelineLayout.ideal_bubble` of a layout given by its numbers."""
    passes = 3 if schedule in ZERO_BUBBLE_SCHEDULES else 1  # the passes of a microbatch's step that fill the bubble
    return (ranks - 1) / (passes * virtual_stages * microbatches + ranks - 1)


def in_flight_microbatches(schedule: str, ranks: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """:meth:`PipelineLayout.in_flight` of a layout given by its numbers."""
    if schedule == "gpipe":
        return float(microbatches)
    if schedule in V_SHAPED_SCHEDULES:  # ZBV warms up 2 (P - r) - 1 passes of half the rank's layers
        return min(2 * microbatches, 2 * (ranks - rank) - 1) / 2
    if PIPELINE_SCHEDULES.get(schedule):
        passes = min(virtual_stages * microbatches, (virtual_stages - 1) * ranks + 2 * (ranks - 1 - rank) + 1)
        return passes / virtual_stages
    return float(min(microbatches, ranks - rank))


def check_pipeline(
    strategy: StrategyConfig,
    pp_size: int,
    schedule: str,
    microbatches: int | None,
    virtual_stages: int,
    *,
    ep_size: int = 1,  # noqa: ARG001 - EP runs within each stage group (kept for callers passing the whole layout)
    cp_size: int = 1,
) -> int:
    """Raise, naming the option and the fix, for a pipeline layout that cannot run; return the microbatch count
    (``pp_size`` when not given). The same checks on every rank, before any process group or model is touched."""
    if isinstance(strategy, DDPConfig | MegatronFSDPConfig):
        raise ValueError(
            f"pp_size={pp_size} with strategy={strategy.name!r} is not supported: pipeline stages are parallelized with "
            "strategy='fsdp2' (FSDP2, TP, CP within each stage). Use strategy='fsdp2'."
        )
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not a schedule: use one of {sorted(PIPELINE_SCHEDULES)}.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"pp_virtual_stages must be a positive integer, got {virtual_stages!r}.")
    if PIPELINE_SCHEDULES[schedule] and virtual_stages < 2:
        raise ValueError(
            f"pp_schedule={schedule!r} runs several stages per rank: set pp_virtual_stages >= 2 (got {virtual_stages})."
        )
    if schedule in V_SHAPED_SCHEDULES and virtual_stages != 2:
        raise ValueError(
            f"pp_schedule={schedule!r} places exactly two stages per rank (in a V): set pp_virtual_stages=2 (got "
            f"{virtual_stages})."
        )
    if not PIPELINE_SCHEDULES[schedule] and virtual_stages != 1:
        raise ValueError(
            f"pp_schedule={schedule!r} runs one stage per rank, so pp_virtual_stages={virtual_stages} cannot apply: use "
            "pp_schedule='interleaved_1f1b' for virtual stages, or pp_virtual_stages=1."
        )
    if cp_size > 1:
        raise ValueError(
            f"pp_size={pp_size} with cp_size={cp_size} is not supported yet: a pipeline step takes whole sequences (no "
            "context-parallel shards). Use pp_size=1 for context parallelism, or cp_size=1."
        )
    microbatches = pp_size if microbatches is None else microbatches
    if not isinstance(microbatches, int) or microbatches < pp_size:
        raise ValueError(
            f"pp_microbatches={microbatches!r} is fewer than the {pp_size} pipeline stages' ranks: a schedule needs at "
            f"least one microbatch per rank in flight (and idles (P-1)/(M+P-1) of the time). Use pp_microbatches >= "
            f"{pp_size}, e.g. {2 * pp_size}."
        )
    rounds = max(1, microbatches // pp_size)
    if schedule in ROUND_SCHEDULES and microbatches % rounds:
        valid = [m for m in range(pp_size, 4 * pp_size + 1) if m % max(1, m // pp_size) == 0]
        raise ValueError(
            f"pp_microbatches={microbatches} with pp_schedule={schedule!r} on {pp_size} pipeline ranks: torch's "
            f"schedule runs the microbatches in rounds of {pp_size} and needs their number to be a multiple of the "
            f"number of rounds ({microbatches} // {pp_size} = {rounds}). Use a multiple of {pp_size}, or one of "
            f"{', '.join(map(str, valid))}."
        )
    return microbatches
