"""Rank-side cases for ``automodel.plan``: what a real gloo run of the loading pipeline holds and reads on each rank,
and the message it refuses a layout with (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from automodel.auto_model import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
from automodel.distributed import MeshContext
from automodel.loading.initialization import local_view
from automodel.loading.pipeline import load_parallelized


def _auto_class(checkpoint: str):
    config = AutoConfig.from_pretrained(checkpoint)
    vision = getattr(config, "vision_config", None) is not None
    return (NeMoAutoModelForImageTextToText if vision else NeMoAutoModelForCausalLM), config


def held_and_read(checkpoint: str, layout: dict[str, Any]) -> dict[str, int]:
    """This rank's parameter shard bytes after a real load (the pipeline ``from_pretrained`` runs) and the bytes the
    loader read for them."""
    auto_class, config = _auto_class(checkpoint)
    context = MeshContext.build(**layout)
    model = auto_class._build_on_meta(config, torch.float32, None, False)
    loaded = load_parallelized(model, context, checkpoint=Path(checkpoint))
    held = sum(local_view(p).numel() * p.element_size() for p in loaded.model.parameters())
    return {"param_bytes": held, "read_bytes": loaded.report.bytes_read}


def refusal(checkpoint: str, layout: dict[str, Any]) -> str | None:
    """The message ``from_pretrained`` (with ``MeshContext.build(**layout)``) refuses the layout with, or None."""
    auto_class, _ = _auto_class(checkpoint)
    try:
        auto_class.from_pretrained(checkpoint, mesh_context=MeshContext.build(**layout))
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None
