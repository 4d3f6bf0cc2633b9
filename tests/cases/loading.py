"""Rank-side cases for ``NeMoAutoModelForCausalLM`` (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from tests.cases.dense import compare_with_reference
from tests.tiny_models import token_batch


def loaded_parity(checkpoint: str, layout: dict[str, Any] | None) -> dict[str, Any]:
    """Load ``checkpoint`` parallelized for ``layout`` and compare with plain transformers in one process."""
    context = MeshContext.build(**layout) if layout is not None else None
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    facts = {
        "on_meta": [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta],
        "buffers": max(
            ((b - dict(reference.named_buffers())[n]).abs().max().item() for n, b in model.named_buffers()),
            default=0.0,
        ),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "training": model.training,
    }
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if reference.config.get_text_config().tie_word_embeddings:
        facts["tied"] = embeddings.weight is head.weight
    if context is None:
        with torch.no_grad():
            batch = token_batch()
            facts["logits"] = (model(batch).logits - reference(batch).logits).abs().max().item()
        return facts
    model.train()
    reference.train()
    return {**facts, **compare_with_reference(reference, model, context, token_batch())}
