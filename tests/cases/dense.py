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
