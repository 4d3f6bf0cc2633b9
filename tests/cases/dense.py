"""Rank-side cases for the dense parallelizer paths (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel.distributed import MeshContext, ModelParallelizer
from tests.tiny_models import build_model, tiny_llama_config, token_batch


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare_with_reference(
    reference: torch.nn.Module, model: torch.nn.Module, context: MeshContext, batch: torch.Tensor
) -> dict[str, Any]:
    """Run forward + backward on both models; return the largest absolute differences (and sanity facts)."""
    ref_out = reference(input_ids=batch, labels=batch)
    ref_out.loss.backward()

    dp_rank, dp_size = context.mesh("dp").get_local_rank(), context.dp_size
    rows = batch.shape[0] // dp_size
    local = slice(dp_rank * rows, (dp_rank + 1) * rows)
    out = model(input_ids=batch[local], labels=batch[local])
    out.loss.backward()

    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=context.mesh("dp").get_group())
    loss /= dp_size
    ref_grads = dict(reference.named_parameters())
    grad_diffs = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        grad_diffs[name] = (_full(param.grad) - ref_grads[name].grad).abs().max().item()
    worst = max(grad_diffs, key=grad_diffs.__getitem__)
    return {
        "logits": (_full(out.logits).detach() - ref_out.logits[local].detach()).abs().max().item(),
        "loss": (loss - ref_out.loss.detach()).abs().item(),
        "grad": grad_diffs[worst],
        "worst_grad": worst,
        "n_grads": len(grad_diffs),
        "n_ref_grads": len(ref_grads),
        "same_class": isinstance(model, type(reference)),
        "has_generate": callable(getattr(model, "generate", None)),
        "has_save_pretrained": callable(getattr(model, "save_pretrained", None)),
    }


def dense_parity(layout: dict[str, Any], activation_checkpointing: Any, tie: bool) -> dict[str, Any]:
    """Parallelize a tiny Llama with ``layout`` and compare against the same model in one plain process."""
    context = MeshContext.build(**layout, activation_checkpointing=activation_checkpointing)
    reference = build_model(tiny_llama_config(tie_word_embeddings=tie))
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    result = compare_with_reference(reference, model, context, token_batch())
    if tie:
        result["tied"] = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return result


def sequence_parallel_is_active(tie: bool) -> dict[str, Any]:
    """Under SP the decoder layers' norms see a sequence shard and hold DTensor weights; outputs stay exact."""
    context = MeshContext.build("fsdp2", tp_size=context_tp_size(), sequence_parallel=True)
    reference = build_model(tiny_llama_config(tie_word_embeddings=tie))
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    seen: dict[str, int] = {}
    norm = model.model.layers[0].input_layernorm

    def record(module, args):
        seen.setdefault("norm_seq", args[0].shape[1])

    norm.register_forward_pre_hook(record)
    batch = token_batch()
    result = compare_with_reference(reference, model, context, batch)
    result["norm_seq"] = seen["norm_seq"]
    result["seq"] = batch.shape[1]
    result["norm_is_dtensor"] = isinstance(norm.weight, DTensor)
    return result


def context_tp_size() -> int:
    """All ranks on the TP axis."""
    return dist.get_world_size()
