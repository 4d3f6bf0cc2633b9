"""What a layout search answers: the suggested layouts, best first, as a table or one JSON object, and, when nothing
fits, why and the smallest world size that does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .candidates import Candidate, Job
from .cost_model import StepTime
from .hardware import Hardware
from .memory import MemoryParts
from .model_facts import ModelFacts

__all__ = ["Suggestion", "Suggestions", "describe_memory", "format_bytes"]

#: Said under every table and in every JSON answer: what the step times are.
TIME_NOTE = (
    "step times are the cost model's (docs/plan.md): they rank layouts and are not measurements; memory is the real "
    "plan's (parameters, gradients, optimizer, gathers) plus the activation estimate"
)


@dataclass(frozen=True)
class Suggestion:
    """One suggested layout: the candidate, its exact per-rank memory (worst rank), its estimated step."""

    candidate: Candidate
    memory: MemoryParts
    time: StepTime
    usable_bytes: int
    job: Job

    @property
    def peak_bytes(self) -> int:
        """The worst rank's estimated peak."""
        return self.memory.peak

    @property
    def step_seconds(self) -> float:
        """The cost model's step time (an estimate that ranks, not a measurement)."""
        return self.time.total

    def layout(self) -> dict[str, Any]:
        """Every searched layout key, defaults included."""
        candidate = self.candidate
        return {
            "tp_size": candidate.tp_size,
            "pp_size": candidate.pp_size,
            "cp_size": candidate.cp_size,
            "ep_size": candidate.ep_size,
            "dp_replicate_size": candidate.dp_replicate_size,
            "dp_shard_size": candidate.dp_shard_size,
            "sequence_parallel": candidate.sequence_parallel,
            "activation_checkpointing": candidate.activation_checkpointing,
            "pp_schedule": candidate.pp_schedule if candidate.pp_size > 1 else None,
            "pp_virtual_stages": candidate.pp_virtual_stages,
        }

    def why(self, best: Suggestion | None = None) -> str:
        """What its step is made of and, beside the best one, what makes it slower."""
        time = self.time
        parts = [
            f"compute {_seconds(time.compute)}" + (f" (recompute {_seconds(time.recompute)})" if time.recompute else "")
        ]
        for label, value, link in (
            ("TP", time.tp, "tp"),
            ("EP all-to-all", time.ep, "ep"),
            ("CP gathers", time.cp, "cp"),
            ("PP sends", time.pp, "pp"),
            ("bubble", time.bubble, None),
        ):
            if value > 0.005 * time.total:
                parts.append(f"{label} {_seconds(value)}" + (f" {time.links[link]}" if link in time.links else ""))
        if time.fsdp:
            crossing = (
                "inter-node" if "inter-node" in (time.links.get("fsdp"), time.links.get("hsdp")) else "intra-node"
            )
            hidden = "hidden under compute" if not time.fsdp_exposed else f"{_seconds(time.fsdp_exposed)} exposed"
            parts.append(f"FSDP {_seconds(time.fsdp)} {crossing}, {hidden}")
        text = "; ".join(parts)
        if best is not None and best is not self:
            text += f" (+{(time.total / best.time.total - 1):.0%} over #1)"
        return text

    def to_dict(self, best: Suggestion | None = None) -> dict[str, Any]:
        """The JSON object of this suggestion."""
        return {
            "layout": self.layout(),
            "micro_batch_size": self.candidate.micro_batch_size,
            "accumulation_steps": self.candidate.accumulation,
            "grad_sync": self.candidate.grad_sync,
            "recipe_overrides": self.candidate.recipe_overrides(self.job),
            "peak_bytes": self.peak_bytes,
            "margin_bytes": self.usable_bytes - self.peak_bytes,
            "step_seconds": self.step_seconds,
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict(),
            "why": self.why(best),
        }


@dataclass(frozen=True)
class Suggestions:
    """A search's answer: ``suggestions`` best first (empty when nothing fits: then ``error`` says why and
    ``smallest_world_size`` where something does), and what the search did."""

    model: str
    facts: ModelFacts
    job: Job
    hardware: Hardware
    usable_bytes: int
    headroom: float
    suggestions: list[Suggestion]
    counts: dict[str, int]
    rejections: dict[str, int]
    refusals: dict[str, str]
    least: tuple[MemoryParts, Candidate] | None
    smallest_world_size: int | None
    seconds: float
    stopped_early: bool = False

    @property
    def ok(self) -> bool:
        """Whether some layout fits."""
        return bool(self.suggestions)

    @property
    def error(self) -> str | None:
        """Why nothing fits (``None`` when something does)."""
        if self.ok:
            return None
        where = f"{self.job.world_size} ranks of {format_bytes(self.hardware.memory_bytes)}"
        budget = f"{format_bytes(self.usable_bytes)} usable with {self.headroom:.0%} headroom"
        if self.least is None:
            rules = "; ".join(list(self.rejections)[:6])
            return f"no layout of {self.facts.name} on {self.job.world_size} ranks passes the size rules: {rules}."
        bound, candidate = self.least
        if bound.peak > self.usable_bytes:
            text = (
                f"no layout of {self.facts.name} fits {where} ({budget}): the least memory any layout needs is "
                f"{format_bytes(bound.peak)} per rank ({candidate.describe()}: {describe_memory(bound)})."
            )
        else:
            refused = "; ".join(f"{layout}: {error.rstrip('.')}" for error, layout in list(self.refusals.items())[:3])
            text = (
                f"no layout of {self.facts.name} fits {where} ({budget}) by the real plan"
                + (f"; refused: {refused}" if refused else "")
                + "."
            )
        if self.smallest_world_size is not None:
            nodes = describe_nodes(self.smallest_world_size, self.job.nproc_per_node)
            text += f" The smallest world size where one fits is {self.smallest_world_size} ranks ({nodes})."
        elif every_plan_refused(self.counts, bound.peak, self.usable_bytes):
            text += " Every layout the memory allows was refused: a larger world size does not change that."
        else:
            text += " No larger world size up to 64 times this one fits."
        return text

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``automodel plan --suggest --json`` prints."""
        best = self.suggestions[0] if self.suggestions else None
        return {
            "ok": self.ok,
            "error": self.error,
            "model": self.model,
            "world_size": self.job.world_size,
            "nproc_per_node": self.job.nproc_per_node,
            "seq_len": self.job.seq_len,
            "global_batch_tokens": self.job.global_batch_tokens,
            "gpu": self.hardware.name,
            "gpu_memory_bytes": self.hardware.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "suggestions": [suggestion.to_dict(best) for suggestion in self.suggestions],
            "smallest_world_size": self.smallest_world_size,
            "searched": {**self.counts, "seconds": self.seconds, "stopped_early": self.stopped_early},
            "note": TIME_NOTE,
        }

    def table(self) -> str:
        """A readable report: the job, what was searched, one block per suggested layout."""
        job, hardware = self.job, self.hardware
        head = [
            f"suggest: {self.facts.name} ({_count(self.facts.total)} parameters) on {job.world_size} ranks "
            f"({describe_nodes(job.world_size, job.nproc_per_node)}), {hardware.name} "
            f"{format_bytes(hardware.memory_bytes)} ({format_bytes(self.usable_bytes)} usable), seq_len {job.seq_len}, "
            f"{job.sequences} sequences per step",
            self._searched(),
        ]
        if not self.ok:
            return "\n".join([*head, f"nothing fits: {self.error}"])
        best = self.suggestions[0]
        lines = []
        for index, suggestion in enumerate(self.suggestions, 1):
            memory = suggestion.memory
            lines += [
                "",
                f"{index}. {suggestion.candidate.describe()}",
                f"   peak {format_bytes(memory.peak)} per rank (rank {memory.rank}), margin "
                f"{format_bytes(self.usable_bytes - memory.peak)}: {describe_memory(memory)}",
                f"   step ~{_seconds(suggestion.step_seconds)} (estimate): {suggestion.why(best)}",
                "   " + " ".join(suggestion.candidate.recipe_overrides(job)),
            ]
        return "\n".join([*head, *lines, "", TIME_NOTE])

    def _searched(self) -> str:
        counts = self.counts
        text = (
            f"searched {counts.get('layouts', 0):,} layouts that pass the size rules "
            f"({len(self.rejections)} rule values dropped others): {counts.get('over_bound', 0):,} over the memory "
            f"bound, {counts.get('planned', 0)} planned exactly (their plans refused {counts.get('refused', 0)} "
            f"candidates and found {counts.get('over_exact', 0)} over memory) in {self.seconds:.1f} s"
        )
        return text + (f"; stopped after {counts.get('planned', 0)} plans" if self.stopped_early else "")


def every_plan_refused(counts: dict[str, int], least_peak: int, usable: int) -> bool:
    """Whether a search found nothing because the model refused every layout it planned (a pinned key it cannot
    take), not for memory: the least hungry layout fits, and no plan was over memory."""
    return bool(counts.get("refused", 0)) and not counts.get("over_exact", 0) and least_peak <= usable


def describe_nodes(world_size: int, nproc_per_node: int) -> str:
    """``"8 nodes of 8"``, ``"1 node of 8"``, ``"2 nodes of 8, the last with 5"``."""
    full, rest = divmod(world_size, nproc_per_node)
    nodes = full + (rest > 0)
    text = f"{nodes} node{'s' if nodes != 1 else ''} of {nproc_per_node}"
    return text + (f", the last with {rest}" if rest and full else "")


def describe_memory(memory: MemoryParts) -> str:
    """``params 1.2 GiB, grads ..., activations ...``: the parts of a peak that are not zero."""
    parts = [
        ("params", memory.params),
        ("grads", memory.grads),
        ("optimizer", memory.optimizer),
        ("gathers", memory.gathers),
        ("activations", memory.activations),
        ("held unsharded", memory.held),
    ]
    return ", ".join(f"{label} {format_bytes(value)}" for label, value in parts if value)


def format_bytes(value: float) -> str:
    """Bytes in GiB, MiB below one GiB, KiB below one MiB."""
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB" if abs(value) >= 2**20 else f"{value / 2**10:.1f} KiB"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 0.01 else f"{value * 1000:.2g} ms"


def _count(number: int) -> str:
    return f"{number / 1e9:.2f} B" if number >= 1e9 else f"{number / 1e6:.2f} M"
