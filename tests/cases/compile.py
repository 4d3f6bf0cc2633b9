"""Rank-side cases for compiled blocks (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.compile import eager_block_classes
from automodel.distributed.model_structure import decoder_layers
from automodel.distributed.runtime import full_tensor
from automodel.training.loop import train_step
from tests.cases.loss import packed_micro_batches
from tests.tiny_models import tiny_config

STEPS = 2
LR = 0.1


def compiled_parity(layout: dict[str, Any], architecture: str = "llama", **config: Any) -> dict[str, Any]:
    """``STEPS`` training steps (packed micro batches, token-weighted loss, SGD in between) of a model with compiled
    blocks and of the same model uncompiled: the worst loss and gradient differences (full tensors) over the steps."""
    hf_config = tiny_config(architecture, **config)
    models = {}
    for compiled in (False, True):
        context = MeshContext.build(**layout, compile=compiled)
        models[compiled] = NeMoAutoModelForCausalLM.from_config(hf_config, mesh_context=context, seed=3)
        models[compiled].train()
    batches = packed_micro_batches(context)
    worst_loss, worst_grad, worst_name, losses = 0.0, 0.0, "", []
    counters = torch._dynamo.utils.counters
    counters.clear()
    for index in range(STEPS):
        if index == STEPS - 1:  # the last step's graph breaks: the steady state (after the first-forward checks)
            counters["graph_break"].clear()
        step = {compiled: train_step(model, batches, context) for compiled, model in models.items()}
        losses.append(step[True].item())
        worst_loss = max(worst_loss, (step[False] - step[True]).abs().item())
        reference = dict(models[False].named_parameters())
        for name, param in models[True].named_parameters():
            difference = (full_tensor(param.grad) - full_tensor(reference[name].grad)).abs().max().item()
            if difference >= worst_grad:
                worst_grad, worst_name = difference, name
        with torch.no_grad():
            for model in models.values():
                for param in model.parameters():
                    param -= LR * param.grad
                    param.grad = None
    blocks = decoder_layers(models[True])
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "steady_graph_breaks": dict(counters["graph_break"]),
        "loss": worst_loss,
        "grad": worst_grad,
        "worst_grad": worst_name,
        "losses": losses,
        "compiled_blocks": sum(hasattr(block.forward, "compiled") for block in blocks)
        - len(eager_block_classes(models[True])),
        "blocks": len(blocks),
        "names_kept": [name for name, _ in models[True].named_parameters()]
        == [name for name, _ in models[False].named_parameters()],
    }


def pipelined_compiled_parity(layout: dict[str, Any]) -> dict[str, Any]:
    """``tests.cases.pipeline.pipeline_parity`` with compiled blocks, and how many graphs dynamo compiled."""
    from tests.cases.pipeline import pipeline_parity

    counters = torch._dynamo.utils.counters
    counters.clear()
    result = pipeline_parity("llama", {**layout, "compile": True})
    return {**result, "graphs": counters["stats"]["unique_graphs"]}
