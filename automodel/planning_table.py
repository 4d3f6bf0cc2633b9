"""The table ``automodel plan`` prints (``Plan.table()``): the verdict, what the parallelizer logs, the pipeline, and
one row per class of ranks with equal local shapes, each row saying which ranks it stands for (once per class)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .planning import Plan, RankPlan

__all__ = ["describe_bytes", "describe_ranks", "plan_table", "shown_layout"]

_COLUMNS = (
    "rank",
    "params",
    "padded",
    "grads",
    "optimizer",
    "ckpt read",
    "largest gather",
    "activations",
    "peak",
    "stands for",
)


def plan_table(plan: Plan) -> str:
    """The readable report of ``plan``."""
    layout = ", ".join(f"{key}={value}" for key, value in plan.layout.items())
    head = [f"plan: {plan.world_size} ranks ({layout}), model {describe_bytes(plan.total_param_bytes)} of parameters"]
    if not plan.ok:
        return "\n".join([*head, f"refused: {plan.error}"])
    head += [f"  {line}" for line in plan.log]
    if plan.pipeline is not None:
        pipeline = plan.pipeline
        head.append(
            f"  pipeline: {pipeline['schedule']}, {pipeline['stages']} stages over {pipeline['ranks']} pipeline "
            f"ranks, {pipeline['microbatches']} microbatches per step, decoder layers per stage "
            f"{pipeline['layers_per_stage']}; ideal bubble {pipeline['bubble']:.1%} of a step"
        )
    head.append(f"  {_activations_line(plan)}")
    rows = [(*_COLUMNS[:-1], "stages", _COLUMNS[-1]) if plan.pipeline is not None else _COLUMNS]
    shown: dict[str, int] = {}  # a class already described, by the rank whose row did
    for rank in plan.ranks:
        members = describe_ranks(rank.stands_for)
        stands_for = f"as rank {shown[members]}" if members in shown else members
        shown.setdefault(members, rank.rank)
        rows.append(_row(rank, stands_for, pipelined=plan.pipeline is not None))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([*head, "", *lines])


def shown_layout(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout as reported: the strategy and the keys that differ from ``MeshContext.build``'s defaults."""
    defaults = {
        "dp_replicate_size": 1,
        "tp_size": 1,
        "cp_size": 1,
        "ep_size": 1,
        "compile": "auto",
        "pp_virtual_stages": 1,
    }
    strategy = layout.get("strategy", "fsdp2")
    shown: dict[str, Any] = {"strategy": getattr(strategy, "name", strategy)}
    if getattr(strategy, "param_dtype", None) is not None:
        shown["param_dtype"] = str(strategy.param_dtype).removeprefix("torch.")
    for key, value in layout.items():
        if key != "strategy" and value not in (defaults.get(key), False, None, "fp32"):
            shown[key] = value if isinstance(value, (int, bool, str)) else str(value)
    return shown


def _activations_line(plan: Plan) -> str:
    """What the activations column holds: the estimate for the batch the plan was given, or why it is empty."""
    if plan.batch is None:
        return "activations: not estimated (no micro batch size and sequence length given); the peak leaves them out"
    return (
        f"activations: estimated for micro batches of {plan.batch['micro_batch_size']} x {plan.batch['seq_len']} "
        "tokens (docs/plan.md); the peak includes them"
    )


def _row(rank: RankPlan, stands_for: str, *, pipelined: bool) -> tuple[str, ...]:
    cells = [
        str(rank.rank),
        describe_bytes(rank.param_bytes),
        describe_bytes(rank.padded_param_bytes),
        describe_bytes(rank.grad_bytes),
        describe_bytes(rank.optimizer_bytes),
        "-" if rank.checkpoint_read_bytes is None else describe_bytes(rank.checkpoint_read_bytes),
        describe_bytes(rank.largest_gather_bytes),
        "-" if rank.activation_bytes_estimate is None else describe_bytes(rank.activation_bytes_estimate),
        describe_bytes(rank.peak_bytes_estimate),
    ]
    if pipelined:
        layers = f"{rank.pipeline_layers} layers, {rank.in_flight_microbatches:g} in flight"
        cells.append(f"{rank.pipeline_stages} ({layers})")
    return (*cells, stands_for)


def describe_ranks(stands_for: list[int]) -> str:
    """``"0-15"``, ``"3, 7"``, ``"512 ranks: 0-511"``: the ranks a row stands for, as runs (counted past 16 ranks)."""
    runs, start = [], stands_for[0]
    for previous, current in zip(stands_for, [*stands_for[1:], None], strict=True):
        if current is None or current != previous + 1:
            runs.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    described = ", ".join(runs[:8]) + (f" ... ({len(runs)} runs)" if len(runs) > 8 else "")
    return f"{len(stands_for)} ranks: {described}" if len(stands_for) > 16 else described


def describe_bytes(value: int) -> str:
    """``"1.7 KiB"``, ``"56.0 MiB"``, ``"1.25 GiB"``."""
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB"
