"""Rank-side cases for context parallelism (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.context_parallel import gather_sequence, shard_batch_for_context_parallel
from tests.parity import gradient_differences
from tests.tiny_models import build_model, tiny_config, token_batch


def cp_parity(
    layout: dict[str, Any], architecture: str | PretrainedConfig, seq_len: int, *, left_padded: bool = False
) -> dict[str, Any]:
    """CP model on load-balanced sequence shards vs the same model in one plain process (CP=1); ``architecture`` is
    a tiny model's name or a config. ``left_padded``: rows padded on the left by 0-3 tokens (the padding masked out of
    attention and of the labels)."""
    context = MeshContext.build(**layout)
    config = architecture if isinstance(architecture, PretrainedConfig) else tiny_config(architecture)
    reference = build_model(config)
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    batch = token_batch(seq_len=seq_len)
    mask = torch.ones_like(batch)
    for row in range(batch.shape[0]):
        mask[row, : row % 4 if left_padded else 0] = 0
    labels = batch.masked_fill(mask == 0, -100)
    padding = {"attention_mask": mask} if left_padded else {}
    ref_out = reference(input_ids=batch, labels=labels, **padding)
    ref_out.loss.backward()

    rows = batch.shape[0] // context.dp_size
    first = context.mesh("dp").get_local_rank() * rows
    cp_mesh = context.mesh("cp")
    local = shard_batch_for_context_parallel(
        batch[first:][:rows],
        labels[first:][:rows],
        cp_mesh,
        attention_mask=mask[first:][:rows] if left_padded else None,
    )
    # Token-weighted loss: each rank divides its sum by (all valid tokens / ranks that average gradients), so the
    # gradient average over dp x cp is the mean over every token of the global batch.
    valid = (labels[:, 1:] != -100).sum().item()
    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        labels=local["shift_labels"],
        shift_labels=local["shift_labels"],
        num_items_in_batch=valid / context.size("dp_cp"),
        **({"attention_mask": local["attention_mask"]} if left_padded else {}),
    )
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=context.mesh("dp_cp").get_group())
    loss /= context.size("dp_cp")
    logits = gather_sequence(out.logits.detach(), cp_mesh)
    return {
        "local_len": local["input_ids"].shape[1],
        "logits": (logits - ref_out.logits[first:][:rows]).abs().max().item(),
        "loss": (loss - ref_out.loss.detach()).abs().item(),
        **gradient_differences(reference, model),
    }


def cp_error(layout: dict[str, Any], architecture: str, seq_len: int | None = None, **overrides: Any) -> str:
    """The error parallelizing (or sharding a batch of ``seq_len`` tokens) raises."""
    context = MeshContext.build(**layout)
    try:
        model = ModelParallelizer().parallelize(build_model(tiny_config(architecture, **overrides)), context)
        if seq_len is not None:
            shard_batch_for_context_parallel(token_batch(seq_len=seq_len), None, context.mesh("cp"))
    except ValueError as error:
        return str(error)
    return f"no error ({type(model).__name__})"
