"""Rank-side cases for the dense parallelizer paths (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel.distributed import MeshContext, ModelParallelizer
from tests.parity import compare_with_reference
from tests.tiny_models import build_model, tiny_llama_config, token_batch


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


def replicated_layers_parity(activation_checkpointing: Any) -> dict[str, Any]:
    """A TP plan that leaves the decoder layers out (only the embedding is sharded) under TP + SP: the layers' weights
    are replicas computed on as local tensors, their blocks run on the whole sequence, and checkpointing (full or
    selective) recomputes them exactly as their forward ran."""
    from automodel.distributed.tensor_parallel import set_user_tp_plan

    context = MeshContext.build(
        "fsdp2", tp_size=context_tp_size(), sequence_parallel=True, activation_checkpointing=activation_checkpointing
    )
    reference = build_model(tiny_llama_config())
    model = copy.deepcopy(reference)
    set_user_tp_plan(model, {"model.embed_tokens": "embedding_rowwise"})
    model = ModelParallelizer().parallelize(model, context)
    return compare_with_reference(reference, model, context, token_batch())


def context_tp_size() -> int:
    """All ranks on the TP axis."""
    return dist.get_world_size()


def reshard_policy_states(policy: bool | None) -> dict[str, Any]:
    """Which FSDP2 units hold unsharded parameters after a forward under ``no_grad``, after a forward whose outputs
    need no gradient, and between a training forward and its backward, under ``reshard_after_forward=policy``; then
    the parity of a training step taken after those forwards."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from automodel.distributed import FSDP2Config

    def unsharded() -> list[str]:
        """The units (by name, the root as ``"root"``) holding an unsharded parameter."""
        units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
        owners = set()
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                owner = max((unit for unit in units if not unit or name.startswith(f"{unit}.")), key=len)
                owners.add(owner or "root")
        return sorted(owners)

    context = MeshContext.build(FSDP2Config(reshard_after_forward=policy))
    reference = build_model(tiny_llama_config())
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    batch = token_batch()
    result: dict[str, Any] = {}
    with torch.no_grad():
        model(batch)
    result["after_no_grad"] = unsharded()
    for param in model.parameters():
        param.requires_grad_(False)
    model(batch)
    result["after_frozen"] = unsharded()
    for param in model.parameters():
        param.requires_grad_(True)
    loss = model(batch, labels=batch).loss
    result["before_backward"] = unsharded()
    loss.backward()
    result["after_backward"] = unsharded()
    model.zero_grad(set_to_none=True)
    result.update(compare_with_reference(reference, model, context, batch))
    return result
