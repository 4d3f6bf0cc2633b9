"""Rank-side cases for the plan-correction sidecars (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from automodel.distributed import MeshContext
from model_sidecars import sidecar_class
from tests.causal_lm_zoo import tiny_config, zoo_batch
from tests.parity import compare_with_reference


def gemma4_moe_parity(layout: dict[str, Any]) -> dict[str, Any]:
    """The tiny Gemma 4 composite with its MoE block on (4 experts, top-2), parallelized by its sidecar for
    ``layout``: parity with plain transformers, and the TP plan it was sharded with."""
    config = tiny_config("gemma4")
    text = config.get_text_config()
    text.enable_moe_block, text.top_k_experts, text.moe_intermediate_size = True, 2, 16
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).train()
    context = MeshContext.build(**layout)
    parallelizer = sidecar_class(type(reference).__name__).parallelizer
    model = parallelizer.parallelize(copy.deepcopy(reference), context)
    return {"plan": dict(model._tp_plan), **compare_with_reference(reference, model, context, zoo_batch())}
