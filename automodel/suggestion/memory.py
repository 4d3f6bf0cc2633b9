"""Per-rank memory of a candidate layout: the cheap bound that prunes, and the exact figures from the real plan.

A rank's peak is its parameter shards, gradients, optimizer states, two FSDP all-gather buffers (the unit running and
the one prefetched), the activations (:func:`automodel.activation_estimate.activation_bytes`, the plan's own formula)
and what a step holds unsharded between micro batches:

- without a pipeline, with gradient accumulation and ``train.grad_sync: step`` (the default), FSDP2 keeps each unit's
  unsharded gradient (in the reduce dtype) until the last micro batch reduces it;
- under a pipeline, torch's schedule turns gradient sync and resharding after backward off until the last
  microbatch, so a rank holds its stages' unsharded parameters and gradients through the step.

:meth:`MemoryModel.bound` computes the first four from the model's parameter counts divided by the layout's sizes,
without padding (every TP-sharded or FSDP-sharded part is at least that large on the worst rank), so it is never above
the exact figure: a layout whose bound does not fit cannot fit. :meth:`MemoryModel.exact` takes them from the real plan
of the worst rank of each pipeline stage group (``automodel.plan``); both add the same activations and held terms.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from automodel.activation_estimate import activation_bytes
from automodel.distributed.pipeline_layout import V_SHAPED_SCHEDULES, in_flight_microbatches
from automodel.distributed.pipeline_stages import stage_layer_counts

from .candidates import Candidate
from .model_facts import LayerFacts, ModelFacts

__all__ = ["HEADROOM", "MemoryModel", "MemoryParts", "RankShare", "Training", "usable_bytes"]

#: The share of a GPU's memory a suggestion leaves free for what the estimate does not count: the CUDA context
#: (about 0.5 GiB), NCCL's buffers, attention workspaces and the caching allocator's fragmentation (5-20%).
HEADROOM = 0.10


def usable_bytes(memory_bytes: int, headroom: float = HEADROOM) -> int:
    """What a layout's estimated peak may reach on a GPU of ``memory_bytes``."""
    return int(memory_bytes * (1 - headroom))


@dataclass(frozen=True)
class Training:
    """How the model trains: element sizes of the load dtype (``param_bytes``), of the compute dtype (FSDP2's
    mixed-precision ``param_dtype``, else the load dtype) and of the gradient reduction (``reduce_dtype``, else the
    compute dtype); optimizer state bytes per trainable element; whether the whole model trains (LoRA: the base is
    frozen, its gradients and states are the adapters' and left out); whether FSDP2 keeps parameters unsharded after
    forward (``reshard_after_forward: never``)."""

    param_bytes: int = 2
    compute_bytes: int = 2
    reduce_bytes: int = 2
    optimizer_bytes: int = 4  # two states per trainable element, in the weights' bf16
    trainable: bool = True
    keep_unsharded: bool = False


@dataclass(frozen=True)
class MemoryParts:
    """One rank's peak, in bytes: ``params`` (padded shards: exact; unpadded: bound), ``grads``, ``optimizer``,
    ``gathers`` (two all-gather buffers), ``activations``, ``held`` (unsharded between micro batches); ``rank``: the
    worst rank (its pipeline rank's first rank); ``exact``: the first four come from the real plan."""

    params: int
    grads: int
    optimizer: int
    gathers: int
    activations: int
    held: int
    rank: int
    exact: bool

    @property
    def peak(self) -> int:
        """The estimated peak of a training step."""
        return self.params + self.grads + self.optimizer + self.gathers + self.activations + self.held

    def to_dict(self) -> dict[str, Any]:
        """The parts and the peak, as JSON."""
        return {**asdict(self), "peak": self.peak}


@dataclass(frozen=True)
class RankShare:
    """What one pipeline rank runs, before sharding: its decoder layers (``layers``: how many; ``unique``: the
    distinct ones; the sums of their parameter elements), whether it holds the first stage (the input embeddings and
    the parts before the layers) and the last (the head), and its stage indices."""

    layers: int
    unique: tuple[LayerFacts, ...]
    sharded: int
    whole: int
    experts: int
    moe_layers: int
    active: float  # parameter elements one token passes through in these layers
    active_experts: float  # of which in routed experts
    first: bool
    last: bool
    stages: tuple[int, ...]

    @property
    def kind(self) -> tuple:
        """What decides the rank's shards: equal kinds hold equal modules, so their plans are equal."""
        return (self.layers, frozenset(self.unique), self.sharded, self.whole, self.experts, self.first, self.last)

    @classmethod
    def of(cls, facts: ModelFacts, layers: tuple[LayerFacts, ...], first: bool, last: bool, stages) -> RankShare:
        """The share of ``layers`` (and the first / last stage's parts)."""
        return cls(
            layers=len(layers),
            unique=tuple(set(layers)),
            sharded=sum(layer.sharded for layer in layers),
            whole=sum(layer.whole for layer in layers),
            experts=sum(layer.experts for layer in layers),
            moe_layers=sum(1 for layer in layers if layer.experts),
            active=sum(facts.active_layer_elements(layer) for layer in layers),
            active_experts=sum(facts.active_expert_elements(layer) for layer in layers),
            first=first,
            last=last,
            stages=tuple(stages),
        )


@functools.lru_cache(maxsize=4096)
def _layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    return tuple(stage_layer_counts(num_layers, num_stages))


def rank_shares(facts: ModelFacts, candidate: Candidate) -> list[RankShare]:
    """Each pipeline rank's share (one share without PP), with the stage split the real run makes."""
    if candidate.pp_size == 1:
        return [RankShare.of(facts, facts.layers, True, True, (0,))]
    ranks, stages = candidate.pp_size, candidate.pp_size * candidate.pp_virtual_stages
    counts = _layer_counts(facts.num_layers, stages)
    starts = [sum(counts[:index]) for index in range(stages)]

    def owner(stage: int) -> int:
        if candidate.pp_schedule in V_SHAPED_SCHEDULES:
            return stage if stage < ranks else 2 * ranks - 1 - stage
        return stage % ranks

    shares = []
    for rank in range(ranks):
        local = tuple(stage for stage in range(stages) if owner(stage) == rank)
        layers = tuple(layer for s in local for layer in facts.layers[starts[s] : starts[s] + counts[s]])
        shares.append(RankShare.of(facts, layers, 0 in local, stages - 1 in local, local))
    return shares


class MemoryModel:
    """The memory of candidates of one model trained one way (``training``) on sequences of ``seq_len`` tokens; see
    the module docstring."""

    def __init__(self, facts: ModelFacts, training: Training, seq_len: int) -> None:
        self.facts = facts
        self.training = training
        self.seq_len = seq_len
        self._shares: dict[tuple, list[RankShare]] = {}

    def shares(self, candidate: Candidate) -> list[RankShare]:
        """:func:`rank_shares`, cached per structure."""
        key = candidate.structure
        if key not in self._shares:
            self._shares[key] = rank_shares(self.facts, candidate)
        return self._shares[key]

    def representatives(self, candidate: Candidate) -> list[int]:
        """One pipeline rank of each :attr:`RankShare.kind` (the first, the last, and one of each kind between):
        the pipeline ranks whose stage groups the real plan simulates."""
        chosen: dict[tuple, int] = {}
        for index, share in enumerate(self.shares(candidate)):
            chosen.setdefault(share.kind, index)
        return sorted(chosen.values())

    def bound(self, candidate: Candidate) -> MemoryParts:
        """The worst pipeline rank's peak with unpadded shards counted from the parameter counts (never above
        :meth:`exact`'s)."""
        worst = None
        for index, share in enumerate(self.shares(candidate)):
            elements = self.local_elements(candidate, share)
            trained = elements if self.training.trainable else 0
            parts = MemoryParts(
                params=elements * self.training.param_bytes,
                grads=trained * self.training.param_bytes,
                optimizer=trained * self.training.optimizer_bytes,
                gathers=2 * self._largest_unit(candidate, share) * self.training.compute_bytes,
                activations=self.activations(candidate, index),
                held=self.held(candidate, share),
                rank=index * candidate.stage_world,
                exact=False,
            )
            worst = parts if worst is None or parts.peak > worst.peak else worst
        return worst

    def exact(self, candidate: Candidate, statics: dict[int, dict[str, int]]) -> MemoryParts:
        """The worst pipeline rank's peak from the real plan's figures of the first rank of each
        :meth:`representatives` pipeline rank (``statics[g]``: ``padded_param_bytes``, ``grad_bytes``,
        ``optimizer_bytes``, ``largest_gather_bytes``), which stand for the pipeline ranks of their kind."""
        shares = self.shares(candidate)
        by_kind = {shares[index].kind: figures for index, figures in statics.items()}
        worst = None
        for index, share in enumerate(shares):
            figures = by_kind[share.kind]
            trained = self.training.trainable  # the plan trains every parameter; LoRA's base is frozen
            parts = MemoryParts(
                params=figures["padded_param_bytes"],
                grads=figures["grad_bytes"] if trained else 0,
                optimizer=figures["optimizer_bytes"] if trained else 0,
                gathers=2 * figures["largest_gather_bytes"],
                activations=self.activations(candidate, index),
                held=self.held(candidate, share),
                rank=index * candidate.stage_world,
                exact=True,
            )
            worst = parts if worst is None or parts.peak > worst.peak else worst
        return worst

    def activations(self, candidate: Candidate, pipeline_rank: int) -> int:
        """The plan's activation estimate for this pipeline rank (its layers, its microbatches in flight, the
        logits on the last stage's rank)."""
        layers, in_flight, logits = None, 1.0, 1
        if candidate.pp_size > 1:
            share = self.shares(candidate)[pipeline_rank]
            layers = share.layers
            in_flight = in_flight_microbatches(
                candidate.pp_schedule,
                candidate.pp_size,
                candidate.accumulation,
                candidate.pp_virtual_stages,
                pipeline_rank,
            )
            logits = (candidate.accumulation if candidate.pp_schedule == "gpipe" else 1) if share.last else 0
        return activation_bytes(
            self.facts.text,
            micro_batch_size=candidate.micro_batch_size,
            seq_len=self.seq_len,
            tp_size=candidate.tp_size,
            cp_size=candidate.cp_size,
            sequence_parallel=candidate.sequence_parallel,
            activation_checkpointing=candidate.activation_checkpointing,
            element_size=self.training.compute_bytes,
            layers=layers,
            in_flight=in_flight,
            logits_kept=logits,
        )

    def held(self, candidate: Candidate, share: RankShare) -> int:
        """Bytes held unsharded between micro batches (see the module docstring)."""
        if candidate.accumulation == 1:
            return 0
        unsharded = self.unsharded_elements(candidate, share)
        grads = unsharded * self.training.reduce_bytes if self.training.trainable else 0
        if candidate.pp_size > 1:
            return unsharded * self.training.compute_bytes + grads
        held = grads if candidate.grad_sync == "step" else 0
        if self.training.keep_unsharded:
            held += unsharded * self.training.compute_bytes
        return held

    def unsharded_elements(self, candidate: Candidate, share: RankShare) -> int:
        """The rank's parameter elements as its FSDP units hold them unsharded (TP and EP still split them)."""
        tp, ep = candidate.tp_size, candidate.ep_size
        dense = share.sharded / tp + share.whole
        experts = share.experts / (ep if ep > 1 else tp)
        if share.first:
            dense += self.facts.embedding / tp + (self.facts.other if candidate.pp_size == 1 else 0)
        if share.last and (candidate.pp_size > 1 or not self.facts.head_tied):
            dense += self.facts.head / tp
        return int(dense + experts)

    def local_elements(self, candidate: Candidate, share: RankShare) -> int:
        """The rank's parameter elements after TP, EP and FSDP2 split them, unpadded."""
        tp, ep = candidate.tp_size, candidate.ep_size
        experts = share.experts
        unsharded = self.unsharded_elements(candidate, share)
        dense = unsharded - experts / (ep if ep > 1 else tp)
        expert_shards = candidate.stage_world if ep > 1 else tp * candidate.fsdp_size
        return int(dense / candidate.fsdp_size + experts / expert_shards)

    def _largest_unit(self, candidate: Candidate, share: RankShare) -> int:
        tp, ep = candidate.tp_size, candidate.ep_size
        units = [layer.sharded / tp + layer.whole + (layer.experts / tp if ep == 1 else 0) for layer in share.unique]
        units += [layer.experts / ep for layer in share.unique if ep > 1]
        if share.first:
            units.append(self.facts.embedding / tp)
        if share.last and (candidate.pp_size > 1 or not self.facts.head_tied):
            units.append(self.facts.head / tp)
        return int(max(units, default=0))
