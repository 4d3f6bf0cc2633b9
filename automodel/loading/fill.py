"""Filling a parallelized, materialized model without a checkpoint: from full in-memory weights, or by the
model's own init module by module."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from .initialization import initialize_missing
from .sharded_loader import LoadReport, load_into, peak_rss_bytes, state_tensors
from .sources import InMemoryTensor

__all__ = ["fill_from_weights", "initialize_all"]


def fill_from_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> LoadReport:
    """Copy each local shard out of the full tensor of the same name in ``weights`` (buffers too)."""
    sources = {name: InMemoryTensor(weights[name].detach()) for name, _ in state_tensors(model) if name in weights}
    loaded = load_into(model, sources, progress=False)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in weights and name not in sources:
                buffer.copy_(weights[name])
    return LoadReport(loaded=loaded)


def initialize_all(model: nn.Module, seed: int, recompute: set[str]) -> LoadReport:
    """Every tensor of ``model`` (and the non-persistent buffers ``recompute``) by its own init, seeded per module."""
    names = {name for name, _ in state_tensors(model)} | recompute
    start = time.perf_counter()
    initialize_missing(model, names, seed=seed)
    return LoadReport(initialized=sorted(names), seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes())
