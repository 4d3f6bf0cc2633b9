"""One training step over a rank's micro batches: forward, backward and the token-weighted loss normalization, on
every layout (a pipeline's schedule, CP's sequence shards, gradient accumulation under FSDP2)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed import MeshContext
from automodel.distributed.context_parallel import shard_batch_for_context_parallel
from automodel.distributed.pipelined_model import PipelinedModel

from .batches import joined_batch
from .loss import FusedLinearCrossEntropy, LossFunction, ModelLoss, fused_schedule_refusal

__all__ = ["model_inputs", "train_step"]


def _valid_targets(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss after the causal shift."""
    return (labels[:, 1:] != -100).sum()


def train_step(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    context: MeshContext,
    loss_fn: LossFunction | None = None,
    *,
    grad_sync: Literal["step", "micro_batch"] = "step",
) -> torch.Tensor:
    """Forward and backward over this rank's micro batches; returns the step's global mean token loss.

    ``loss_fn(model, inputs, num_items_in_batch)`` computes a micro batch's loss (default: the model's own; see
    ``automodel.training.loss`` for the fused linear cross-entropy).

    Each micro batch's loss is its token-loss sum divided by (the step's valid tokens over all data-parallel ranks /
    the ranks gradients are averaged over), so the averaged gradient is the mean over every token of the global
    batch, however tokens fall into micro batches, ranks and context-parallel shards.

    ``grad_sync`` (FSDP2, ``train.grad_sync``): ``"step"`` reduces the gradients once, after the last micro batch
    (FSDP2 then holds each unit's unsharded gradient through the accumulation); ``"micro_batch"`` after every micro
    batch, so only the sharded gradients persist between micro batches.
    """
    if grad_sync not in ("step", "micro_batch"):
        raise ValueError(f"grad_sync={grad_sync!r}: use 'step' or 'micro_batch'.")
    device = next(model.parameters()).device
    valid = torch.stack([_valid_targets(batch["labels"]) for batch in micro_batches]).sum().float().to(device)
    dist.all_reduce(valid, group=context.mesh("dp").get_group())  # on the device: NCCL reduces device tensors only
    averaged_over = context.size("dp_cp")
    num_items = (valid / averaged_over).to(device)
    if isinstance(model, PipelinedModel):
        return _pipelined_train_step(model, micro_batches, context, loss_fn, num_items)
    if loss_fn is None or isinstance(loss_fn, ModelLoss):  # a router loss counts once per step, not per micro batch
        loss_fn = ModelLoss(aux_share=1 / len(micro_batches))
    total = torch.zeros((), device=device)
    # ZeRO-2 (reshard_after_forward never): the parameters stay unsharded through the accumulation, gathered once.
    keep_unsharded = getattr(context.strategy, "reshard_after_forward", None) is False
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last or grad_sync == "micro_batch")
            if keep_unsharded:
                model.set_reshard_after_backward(last)
        inputs = model_inputs(batch, context, device)
        loss = loss_fn(model, inputs, num_items)
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total, group=context.mesh("dp_cp").get_group())
    return total / averaged_over


def _pipelined_train_step(
    model: PipelinedModel,
    micro_batches: list[dict[str, torch.Tensor]],
    context: MeshContext,
    loss_fn: LossFunction | None,
    num_items: torch.Tensor,
) -> torch.Tensor:
    """One schedule step over this rank's rows (its micro batches, concatenated: the schedule splits them into the
    layout's microbatches); the same loss normalization as without PP."""
    batch = joined_batch(micro_batches)
    head_loss = loss_fn.from_head_input if isinstance(loss_fn, FusedLinearCrossEntropy) else None
    refusal = fused_schedule_refusal(model) if head_loss is not None else None
    if refusal is not None:  # the same on every rank, before the schedule runs
        raise ValueError(f"train.loss=fused: {refusal}.")
    loss = model.train_step(**batch, num_items_in_batch=num_items, head_loss=head_loss).to(num_items.device)
    dist.all_reduce(loss, group=context.mesh("dp_cp").get_group())
    return loss / context.size("dp_cp")


def model_inputs(batch: dict[str, torch.Tensor], context: MeshContext, device: torch.device) -> dict:
    """The forward arguments of a collated micro batch: this CP rank's part of it under CP, ``position_ids`` of
    packed sequences (transformers then masks each packed example to itself), the image tensors of a
    vision-language batch, and no KV cache (training)."""
    if context.cp_size == 1:
        # The ids, labels, packed positions, and a vision-language batch's image tensors and per-token inputs.
        inputs = {key: value.to(device) for key, value in batch.items() if key != "num_tokens"}
        return {**inputs, "use_cache": False}
    local = shard_batch_for_context_parallel(
        batch["input_ids"], batch["labels"], context.mesh("cp"), batch.get("position_ids"), batch.get("attention_mask")
    )
    inputs = {
        "input_ids": local["input_ids"].to(device),
        "position_ids": local["position_ids"].to(device),
        "labels": local["shift_labels"].to(device),
        "shift_labels": local["shift_labels"].to(device),
        "use_cache": False,
    }
    if "attention_mask" in local:
        inputs["attention_mask"] = local["attention_mask"].to(device)
    return inputs
