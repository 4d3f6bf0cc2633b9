"""The step-time cost model that ranks candidate layouts: compute from the model's FLOPs at a stated efficiency, the
bytes each parallel axis moves over the link it lies on, the pipeline bubble, FSDP2's traffic where it outgrows the
compute it hides under, and the optimizer step.

Every constant is in ``docs/plan.md`` ("The cost model"), with what the model leaves out. It orders layouts; its
seconds are not a measurement and are never reported as one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from automodel.distributed.pipeline_layout import ideal_bubble

from .candidates import Candidate
from .hardware import Hardware
from .memory import MemoryModel, RankShare

__all__ = [
    "ATTENTION_FLOPS",
    "COMPUTE_EFFICIENCY",
    "FLOPS_PER_PARAMETER",
    "HOP_LATENCY_S",
    "LINK_EFFICIENCY",
    "CostModel",
    "StepTime",
]

#: Share of the GPU's dense peak FLOP/s the model's kernels reach while they run (communication excluded):
#: torchtitan's Llama 3 runs on H100s report 40-50% MFU with their communication included.
COMPUTE_EFFICIENCY = 0.5
#: Share of a link's rate a collective's bus bandwidth reaches for large messages (NCCL on NVLink and InfiniBand).
LINK_EFFICIENCY = 0.8
#: Latency of one step of a ring collective (a message to the next rank and its arrival): NVLink within a node,
#: InfiniBand across (NCCL's ring all-gather and reduce-scatter take ``n - 1`` steps, its all-reduce ``2 (n - 1)``).
HOP_LATENCY_S = {"intra-node": 3e-6, "inter-node": 10e-6}
#: Training FLOPs per parameter element a token passes through: 2 forward, 4 backward.
FLOPS_PER_PARAMETER = 6
#: Attention-score FLOPs per token, per token of its context and per query channel (heads x head dim), in a layer:
#: QK^T and AV at 2 FLOPs a multiply-add (4), halved by the causal mask (2), times 3 for training (forward and
#: backward).
ATTENTION_FLOPS = 6


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's estimated seconds and their parts, for the slowest pipeline rank: ``compute`` (with
    ``recompute``, activation checkpointing's), the exposed collectives of ``tp``, ``ep``, ``cp`` and ``pp``, the
    pipeline ``bubble``, ``fsdp`` (all of FSDP2's and HSDP's traffic) of which ``fsdp_exposed`` outgrows the compute,
    and the ``optimizer`` step. ``links`` says which axes cross nodes."""

    compute: float
    recompute: float
    tp: float
    ep: float
    cp: float
    pp: float
    bubble: float
    fsdp: float
    fsdp_exposed: float
    optimizer: float
    links: dict[str, str]

    @property
    def total(self) -> float:
        """The step: compute (recompute included), exposed collectives, bubble, FSDP2's excess and optimizer."""
        return self.compute + self.tp + self.ep + self.cp + self.pp + self.bubble + self.fsdp_exposed + self.optimizer

    def to_dict(self) -> dict[str, Any]:
        """The parts and the total, as JSON."""
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class _MicroStep:
    compute: float
    recompute: float
    tp: float
    ep: float
    cp: float
    pp: float

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.ep + self.cp + self.pp


class CostModel:
    """Step times of candidates for one model (``memory``: its facts, training setup and sequence length) on
    ``hardware``."""

    def __init__(self, memory: MemoryModel, hardware: Hardware) -> None:
        self.memory = memory
        self.facts = memory.facts
        self.training = memory.training
        self.hardware = hardware

    def step_time(self, candidate: Candidate) -> StepTime:
        """The estimated step of ``candidate`` (see the module docstring)."""
        shares = self.memory.shares(candidate)
        steps = [self._micro_step(candidate, share) for share in shares]
        slowest = max(range(len(steps)), key=lambda index: steps[index].total)
        step, share = steps[slowest], shares[slowest]
        count = candidate.accumulation
        busy = count * step.total
        bubble = 0.0
        if candidate.pp_size > 1:
            idle = ideal_bubble(candidate.pp_schedule, candidate.pp_size, count, candidate.pp_virtual_stages)
            bubble = busy * idle / (1 - idle)
        fsdp = self._fsdp(candidate, share)
        computing = count * step.compute
        return StepTime(
            compute=computing,
            recompute=count * step.recompute,
            tp=count * step.tp,
            ep=count * step.ep,
            cp=count * step.cp,
            pp=count * step.pp,
            bubble=bubble,
            fsdp=fsdp,
            fsdp_exposed=max(0.0, fsdp - computing) if self.hardware.overlaps_communication else fsdp,
            optimizer=self._optimizer(candidate, share),
            links=self._links(candidate),
        )

    # ---------------------------------------------------------------------------------------------------------
    # Per micro batch.
    # ---------------------------------------------------------------------------------------------------------

    def _micro_step(self, candidate: Candidate, share: RankShare) -> _MicroStep:
        facts, seq = self.facts, self.memory.seq_len
        tokens = candidate.micro_batch_size * seq / candidate.cp_size  # this rank's tokens (TP ranks share them)
        attention = ATTENTION_FLOPS * seq * facts.attention_width
        # The routed experts' grouped GEMMs run at the roofline of their shapes (see expert_gemm_rate).
        experts = FLOPS_PER_PARAMETER * share.active_experts / self.expert_gemm_rate(candidate, tokens)
        dense = FLOPS_PER_PARAMETER * (share.active - share.active_experts) + experts
        flops = dense + share.layers * attention
        recompute = 0.0
        if candidate.activation_checkpointing in (True, "full"):
            recompute = flops / 3  # the layers' forward again
        elif candidate.activation_checkpointing == "selective":
            recompute = share.layers * attention / 3  # the attention kernel's forward (matmul outputs are kept)
        if share.last:
            flops += FLOPS_PER_PARAMETER * facts.vocab * facts.hidden
        rate = self.hardware.peak_flops * COMPUTE_EFFICIENCY * candidate.tp_size
        element = self.training.compute_bytes
        recomputed = bool(candidate.activation_checkpointing)
        return _MicroStep(
            compute=tokens * (flops + recompute) / rate,
            recompute=tokens * recompute / rate,
            tp=self._tp(candidate, share, tokens, element, recomputed),
            ep=self._ep(candidate, share, tokens, element, recomputed),
            cp=self._cp(candidate, share, tokens, element, recomputed),
            pp=self._pp(candidate, element),
        )

    def expert_gemm_rate(self, candidate: Candidate, tokens: float) -> float:
        """The share of the compute rate the routed experts' GEMMs reach: the roofline's, ``min(1, intensity x
        HBM bandwidth / peak)``, of their least intense GEMM. A rank's experts see ``rows`` tokens each
        (``tokens x top_k / experts``, times ``ep / tp`` under EP: the EP group's tokens, each TP rank dispatching a
        slice), over the expert width (split by TP when EP is off) and the hidden size; the intensity of an
        ``m x k x n`` GEMM in FLOPs per byte is ``1 / (1/m + 1/k + 1/n)``. TP-sharded experts get thin GEMMs and EP
        thick ones: why peers keep experts out of TP (Megatron's ``expert_tensor_parallel_size=1``)."""
        facts = self.facts
        if not facts.experts or not facts.experts_per_token:
            return 1.0
        ep, tp = candidate.ep_size, candidate.tp_size
        rows = tokens * facts.experts_per_token / facts.experts * (ep / tp if ep > 1 else 1)
        width = facts.expert_width / (tp if ep == 1 else 1)
        intensity = 1 / (1 / rows + 1 / width + 1 / facts.hidden)
        return min(1.0, intensity * self.hardware.hbm_bytes_per_s / self.hardware.peak_flops)

    def _tp(self, candidate: Candidate, share: RankShare, tokens: float, element: int, recomputed: bool) -> float:
        """Two all-reduces (or, with sequence parallelism, an all-gather and a reduce-scatter: the same bytes) per
        layer forward, two backward, two more when the forward is recomputed; the embedding's all-reduce; the head's
        logits all-gather and its input gradient's all-reduce."""
        tp = candidate.tp_size
        if tp == 1:
            return 0.0
        all_reduce = 2 * tokens * self.facts.hidden * element * (tp - 1) / tp
        count = share.layers * (4 + (2 if recomputed else 0)) + (1 if share.first else 0) + (1 if share.last else 0)
        seconds = self._collectives(count, all_reduce, 2 * (tp - 1), 1, tp)
        if share.last:
            seconds += self._collectives(1, tokens * self.facts.vocab * element * (tp - 1) / tp, tp - 1, 1, tp)
        return seconds

    def _ep(self, candidate: Candidate, share: RankShare, tokens: float, element: int, recomputed: bool) -> float:
        """Per MoE layer, the dispatch and combine all-to-alls forward and backward (again when recomputed), each
        moving the rank's slice of tokens (``tokens / tp``) times ``top_k`` hidden vectors."""
        ep = candidate.ep_size
        if ep == 1:
            return 0.0
        per_all_to_all = tokens / candidate.tp_size * self.facts.experts_per_token * self.facts.hidden * element
        count = share.moe_layers * (4 + (2 if recomputed else 0))
        return self._collectives(count, per_all_to_all * (ep - 1) / ep, ep - 1, 1, ep)

    def _cp(self, candidate: Candidate, share: RankShare, tokens: float, element: int, recomputed: bool) -> float:
        """Per layer, the keys' and values' all-gather forward (again when recomputed) and their gradients'
        reduce-scatter backward: each rank receives the other ``cp - 1`` ranks' shards."""
        cp = candidate.cp_size
        if cp == 1:
            return 0.0
        local_kv = 2 * tokens * self.facts.kv_width / candidate.tp_size * element
        count = share.layers * (2 + (1 if recomputed else 0))
        return self._collectives(count, local_kv * (cp - 1), cp - 1, candidate.tp_size, cp)

    def _pp(self, candidate: Candidate, element: int) -> float:
        """Per microbatch, each of the rank's stages sends its output forward and receives its gradient back."""
        if candidate.pp_size == 1:
            return 0.0
        activation = candidate.micro_batch_size * self.memory.seq_len * self.facts.hidden * element
        return self._collectives(
            2 * candidate.pp_virtual_stages, activation, 1, candidate.stage_world, candidate.pp_size
        )

    # ---------------------------------------------------------------------------------------------------------
    # Per step.
    # ---------------------------------------------------------------------------------------------------------

    def _fsdp(self, candidate: Candidate, share: RankShare) -> float:
        """FSDP2's all-gathers (forward and backward of each micro batch; once per step with ``reshard_after_forward:
        never``) and reduce-scatters (each micro batch with ``grad_sync: micro_batch``, else once per step) of each
        unit (a decoder layer, its experts, the embeddings, the head), over the dense units' shard group and the
        expert units' (``ep_shard``); HSDP's all-reduce of each unit's gradient shard across the replicas once per
        step."""
        training, count = self.training, candidate.accumulation
        unsharded = self.memory.unsharded_elements(candidate, share)
        experts = share.experts / candidate.ep_size if candidate.ep_size > 1 else 0
        dense = unsharded - experts
        dense_units = share.layers + int(share.first) + int(share.last)
        expert_units = share.moe_layers if experts else 0
        gathers = 2 * (1 if training.keep_unsharded else count)
        reduces = count if candidate.grad_sync == "micro_batch" and candidate.pp_size == 1 else 1
        reduce_bytes = training.reduce_bytes if training.trainable else 0
        seconds = 0.0
        for elements, units, stride, size in (
            (dense, dense_units, candidate.tp_size, candidate.fsdp_size),
            (experts, expert_units, candidate.ep_size, candidate.ep_shard_size),
        ):
            if elements == 0 or size == 1:
                continue
            share_moved = (size - 1) / size
            seconds += self._collectives(gathers * units, elements * share_moved * training.compute_bytes / units,
                                         size - 1, stride, size)  # fmt: skip
            if reduce_bytes:
                seconds += self._collectives(reduces * units, elements * share_moved * reduce_bytes / units,
                                             size - 1, stride, size)  # fmt: skip
        replicas = candidate.dp_replicate_size
        if replicas > 1 and reduce_bytes:
            shard = dense * reduce_bytes / candidate.fsdp_size
            stride = candidate.stage_world // replicas
            moved = 2 * shard * (replicas - 1) / replicas / dense_units
            seconds += self._collectives(dense_units, moved, 2 * (replicas - 1), stride, replicas)
        return seconds

    def _optimizer(self, candidate: Candidate, share: RankShare) -> float:
        """AdamW's step over the rank's trainable shards: memory-bound, at the HBM bandwidth."""
        if not self.training.trainable or not self.training.optimizer_bytes:
            return 0.0
        elements = self.memory.local_elements(candidate, share)
        # The parameter read and written, its gradient read, and each optimizer state read and written.
        moved = elements * (3 * self.training.param_bytes + 2 * self.training.optimizer_bytes)
        return moved / self.hardware.hbm_bytes_per_s

    # ---------------------------------------------------------------------------------------------------------
    # Links.
    # ---------------------------------------------------------------------------------------------------------

    def _within_node(self, stride: int, size: int) -> bool:
        """Whether the groups of an axis (members ``stride`` ranks apart, ``size`` of them) lie within a node:
        ranks fill nodes in order, ``tp`` innermost, then ``cp``, ``dp_shard``, ``dp_replicate``, ``pp``."""
        return stride * size <= self.hardware.nproc_per_node

    def _collectives(self, count: float, moved: float, hops: int, stride: int, size: int) -> float:
        """Seconds of ``count`` collectives of an axis (members ``stride`` ranks apart, ``size`` of them), each
        moving ``moved`` bytes per rank in ``hops`` ring steps: the bytes at the link's bandwidth (NVLink within a
        node, the network across) plus each step's latency."""
        within = self._within_node(stride, size)
        gbps = self.hardware.intra_node_gbps if within else self.hardware.inter_node_gbps
        latency = HOP_LATENCY_S["intra-node" if within else "inter-node"]
        return count * (moved / (gbps * 1e9 / 8 * LINK_EFFICIENCY) + hops * latency)

    def _links(self, candidate: Candidate) -> dict[str, str]:
        axes = {
            "tp": (1, candidate.tp_size),
            "cp": (candidate.tp_size, candidate.cp_size),
            "fsdp": (candidate.tp_size, candidate.fsdp_size),
            "hsdp": (candidate.stage_world // candidate.dp_replicate_size, candidate.dp_replicate_size),
            "ep": (1, candidate.ep_size),
            "pp": (candidate.stage_world, candidate.pp_size),
        }
        return {
            axis: "intra-node" if self._within_node(stride, size) else "inter-node"
            for axis, (stride, size) in axes.items()
            if size > 1
        }
