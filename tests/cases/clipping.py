"""Rank-side cases for gradient clipping and optimizer steps in a hand-written loop (run inside
``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.grad_clipping import clip_grad_norm_
from automodel.distributed.runtime import full_tensor
from tests.parity import local_rows
from tests.tiny_models import build_model, tiny_config, token_batch

MAX_NORM = 0.5  # below the tiny models' gradient norms, so the step really clips
LR = 1e-2


def clipped_step_parity(layout: dict[str, Any], architecture: str, clip: str) -> dict[str, Any]:
    """One forward / backward / clip / ``AdamW(foreach=True)`` step on the parallelized model and on the plain one;
    the norms before clipping and the largest difference of the updated weights. ``clip``: ``"torch"`` for
    ``torch.nn.utils.clip_grad_norm_``, ``"automodel"`` for ``automodel.clip_grad_norm_``."""
    context = MeshContext.build(**layout)
    reference = build_model(tiny_config(architecture)).train()
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context).train()
    batch = token_batch()
    reference(input_ids=batch, labels=batch).loss.backward()
    rows = batch[local_rows(context, batch.shape[0])]
    model(input_ids=rows, labels=rows).loss.backward()

    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    clipper = torch.nn.utils.clip_grad_norm_ if clip == "torch" else clip_grad_norm_
    norm = full_tensor(clipper(model.parameters(), MAX_NORM))
    for module in (reference, model):
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, foreach=True)
        optimizer.step()
    updated = dict(reference.named_parameters())
    diffs = {
        name: (full_tensor(param.detach()) - updated[name].detach()).abs().max().item()
        for name, param in model.named_parameters()
    }
    worst = max(diffs, key=diffs.__getitem__)
    return {
        "norm": norm.item(),
        "reference_norm": reference_norm.item(),
        "weights": diffs[worst],
        "worst": worst,
        "all_dtensors": all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()),
    }
