"""The check that a model keeps packed examples apart before SFT trains on packed sequences.

Packed sequences carry ``position_ids`` that restart at 0 for every example; transformers' mask creation turns them
into a block-diagonal causal mask (and the CP kernel does the same on every shard). A model whose attention does not
go through that mask creation (custom masks, remote code, some attention implementations) would let every example
attend to the ones packed before it. Rather than trusting names, the check runs the model: one tiny packed sequence
of two documents against the second document alone, on every rank, before training starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed import MeshContext
from automodel.distributed.context_parallel import gather_sequence, shard_batch_for_context_parallel
from automodel.distributed.fsdp import reshard_all
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import full_tensor

from .data import IGNORE_INDEX

__all__ = ["PackingNotSupportedError", "check_packed_attention"]


class PackingNotSupportedError(ValueError):
    """The model's attention lets packed examples see each other."""


@torch.no_grad()
def check_packed_attention(model: nn.Module, context: MeshContext, *, tolerance: float) -> float:
    """Run a packed sequence of two documents and the second document alone; raise ``PackingNotSupportedError`` when
    the second document's logits differ by more than ``tolerance`` (relative to the largest logit). Collective;
    returns the relative difference."""
    vocab = model.config.get_text_config().vocab_size
    half = 8 * context.cp_size  # each half splits into 2 * cp_size chunks under CP
    tokens = torch.randint(0, vocab, (1, 2 * half), generator=torch.Generator().manual_seed(0))
    packed_positions = torch.arange(half).repeat(1, 2)
    second_alone = torch.cat([tokens[:, half:], tokens[:, :half]], dim=1)  # causal: what follows cannot matter
    was_training = model.training
    model.eval()
    try:
        if isinstance(model, PipelinedModel):
            difference = _pipelined_difference(model, tokens, packed_positions, second_alone, half)
        else:
            packed = _logits(model, context, tokens, packed_positions)[:, half:]
            alone = _logits(model, context, second_alone, None)[:, :half]
            difference = ((packed - alone).abs().max() / alone.abs().max().clamp(min=1.0)).reshape(1)
    except TypeError as error:  # a forward that takes no position_ids
        raise PackingNotSupportedError(
            f"data.packing=true needs a model whose forward takes position_ids; {type(model).__name__} refused them "
            f"({error}). Set data.packing=false."
        ) from error
    finally:
        model.train(was_training)
        reshard_all(model)
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    if difference.item() > tolerance:
        implementation = getattr(model.config, "_attn_implementation", None)
        raise PackingNotSupportedError(
            f"data.packing=true: {type(model).__name__} (attn_implementation={implementation!r}) lets a packed example "
            f"attend to the examples before it (a second packed document's logits differ from the document alone "
            f"by {difference.item():.2e} of the largest logit): its attention does not build transformers' "
            "packed-sequence mask from position_ids. Set data.packing=false, or choose another attn_implementation."
        )
    return difference.item()


def _pipelined_difference(
    model: PipelinedModel, tokens: torch.Tensor, positions: torch.Tensor, second_alone: torch.Tensor, half: int
) -> torch.Tensor:
    """Under PP (no logits leave the last stage): the second document's mean token loss packed and alone, over the
    same predictions (one row per pipeline microbatch), as a relative difference."""
    rows = model.layout.microbatches
    packed_labels = torch.full_like(tokens, IGNORE_INDEX)
    packed_labels[:, half + 1 :] = tokens[:, half + 1 :]  # the second document's tokens after its first
    alone_labels = torch.full_like(tokens, IGNORE_INDEX)
    alone_labels[:, 1:half] = second_alone[:, 1:half]
    packed = model.eval_step(
        input_ids=tokens.repeat(rows, 1), labels=packed_labels.repeat(rows, 1), position_ids=positions.repeat(rows, 1)
    )
    alone = model.eval_step(input_ids=second_alone.repeat(rows, 1), labels=alone_labels.repeat(rows, 1))
    difference = ((packed - alone).abs() / alone.abs().clamp(min=1.0)).reshape(1)
    return difference.to(next(model.parameters()).device)  # reduced on the device (NCCL)


def _logits(model: nn.Module, context: MeshContext, tokens: torch.Tensor, positions: torch.Tensor | None):
    device = next(model.parameters()).device
    if context.cp_size > 1:
        local = shard_batch_for_context_parallel(tokens, None, context.mesh("cp"), positions)
        out = model(
            input_ids=local["input_ids"].to(device), position_ids=local["position_ids"].to(device), use_cache=False
        )
        return gather_sequence(full_tensor(out.logits).float(), context.mesh("cp"))
    inputs = {"input_ids": tokens.to(device), "use_cache": False}
    if positions is not None:
        inputs["position_ids"] = positions.to(device)
    return full_tensor(model(**inputs).logits).float()
