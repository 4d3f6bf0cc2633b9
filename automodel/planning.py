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
ranks it stands for. Simulating a rank of an 8,192-rank job takes one or two seconds (building the model on meta and
torch's ``fully_shard``, whose cost per parameter no longer grows with the shard group: ``docs/performance.md``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from .planning_processes import SimulationError, one_line, simulate_elsewhere, start_helper
from .planning_simulation import (
    DTYPES,
    OPTIMIZER_STATES,
    RankPlan,
    Request,
    Target,
    refusal_in_this_process,
    simulate_in_this_process,
)
from .planning_table import shown_layout

__all__ = ["Plan", "RankPlan", "SimulationError", "layout_refusal", "plan"]

#: What a simulating child runs (``planning_processes.simulate_elsewhere``).
_SIMULATION = "automodel.planning_simulation:simulate_here"


@dataclass(frozen=True)
class Plan:
    """The plan of one layout: ``ok`` and ``error`` (the exact message the real run would raise), the model's total
    parameter bytes, one :class:`RankPlan` per simulated rank class, rank 0's parallelization plans
    (``ParallelPlan.to_dict()``: one, or one per local pipeline stage) and their lines (``ParallelPlan.describe()``,
    what the real run logs)."""

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
    #: Rank 0's ``ParallelPlan.to_dict()``: one, or one per local pipeline stage.
    parallel_plans: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``automodel plan --json`` prints."""
        return {**asdict(self), "ranks": [rank.to_dict() for rank in self.ranks]}

    def table(self) -> str:
        """A readable report: the verdict, the log lines, and one row per rank class (``planning_table``)."""
        from .planning_table import plan_table

        return plan_table(self)


def _check_layout_keys(layout: Mapping[str, Any]) -> None:
    """A key that is not a keyword of ``MeshContext.build`` is a mistake in the call, not a layout the model refuses:
    a ``TypeError`` naming it, with the close matches."""
    import difflib
    import inspect

    from automodel.distributed import MeshContext

    keywords = [name for name in inspect.signature(MeshContext.build).parameters if name != "cls"]
    unknown = [key for key in layout if key not in keywords]
    if unknown:
        hints = []
        for key in unknown:
            matches = difflib.get_close_matches(key, keywords, n=3, cutoff=0.6)
            hints.append(f"{key!r}" + (f" (did you mean {', '.join(map(repr, matches))}?)" if matches else ""))
        raise TypeError(f"layout has keys that are not keywords of MeshContext.build: {', '.join(hints)}.")


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
    first_rank_here: bool = False,
) -> Plan:
    """Plan ``model`` (a local checkpoint folder or a hub id: its config, and the safetensors headers where the
    files are present) on ``world_size`` ranks with ``layout`` (the keyword arguments of ``MeshContext.build``:
    ``strategy``, ``dp_replicate_size``, ``tp_size``, ``cp_size``, ``ep_size``, ``sequence_parallel``,
    ``activation_checkpointing`` ...). ``ranks`` picks the simulated ranks (default: a representative set).

    Each simulated rank runs in a fresh child process under torch's fake process group (up to 4 at a time), so
    this works from any process, one that runs a real process group included. ``first_rank_here``: rank 0 runs in
    this process instead, beside the helper's start (seconds sooner): for a process that plans once and runs no
    process group and no other plan meanwhile (the ``automodel`` command), as one process is one simulated rank.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(OPTIMIZER_STATES)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    _check_layout_keys(layout or {})
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(str(dtype))
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)}.")
    request = Request(
        str(model), world_size, dict(layout or {}), torch_dtype, micro_batch_size, seq_len, optimizer, trust_remote_code
    )
    Target.config_of(request.model, trust_remote_code)  # a model that cannot be resolved: its one line, here
    start_helper(_SIMULATION)  # its imports run beside the first rank's simulation
    first_rank = ranks[0] if ranks else 0
    if first_rank_here and first_rank == 0 and not (dist.is_available() and dist.is_initialized()):
        # Rank 0 in this process, as layout_refusal does (always rank 0 here: one process is one simulated rank).
        try:
            first = simulate_in_this_process(request, classes=not ranks)
        except Exception as error:  # noqa: BLE001 - said once, in one line, as a forked rank's failure is
            raise SimulationError(f"simulating rank 0 of {world_size} failed: {one_line(error)}") from None
    else:
        first = simulate_elsewhere(_SIMULATION, request, first_rank, classes=not ranks)
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
        outcomes = [
            first,
            *pool.map(lambda rank: simulate_elsewhere(_SIMULATION, request, rank, classes=False), others),
        ]
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
        first["parallel_plans"],
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
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES[str(dtype)]
    request = Request(str(model), world_size, dict(layout or {}), torch_dtype, None, None, "adamw", trust_remote_code)
    if dist.is_available() and dist.is_initialized():
        return simulate_elsewhere(_SIMULATION, request, 0, classes=False)["error"]
    return refusal_in_this_process(request)


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


def _standing_for(figures: RankPlan, members: list[int]) -> RankPlan:
    return replace(figures, stands_for=members)
