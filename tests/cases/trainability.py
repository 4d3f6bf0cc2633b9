"""Rank-side cases for the trainability policy: frozen parameters stay frozen on every path."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from automodel.distributed import MeshContext, ModelParallelizer
from tests.parity import compare_with_reference
from tests.tiny_models import build_model, tiny_config, token_batch


def freeze_embeddings_and_norms(model: nn.Module) -> None:
    """The policy under test: embeddings and every norm frozen, everything else trainable."""
    for name, param in model.named_parameters():
        param.requires_grad_(not ("embed" in name or "norm" in name))


def frozen_parity(layout: dict[str, Any], architecture: str, via: str) -> dict[str, Any]:
    """Parallelize a tiny model whose embeddings and norms are frozen, ``via`` the context's
    ``reapply_trainability`` callback or by freezing before ``parallelize``; compare with the same frozen model in
    one process. Reports which parameters are trainable after parallelization."""
    reference = build_model(tiny_config(architecture))
    model = copy.deepcopy(reference)
    freeze_embeddings_and_norms(reference)
    if via == "callback":
        context = MeshContext.build(**layout, reapply_trainability=freeze_embeddings_and_norms)
    else:
        freeze_embeddings_and_norms(model)
        context = MeshContext.build(**layout)
    model = ModelParallelizer().parallelize(model, context)
    frozen = sorted(name for name, param in model.named_parameters() if not param.requires_grad)
    expected = sorted(name for name, param in reference.named_parameters() if not param.requires_grad)
    return {"frozen": frozen, "expected": expected, **compare_with_reference(reference, model, context, token_batch())}
