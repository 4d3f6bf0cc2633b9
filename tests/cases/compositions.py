"""Rank-side cells of the composition sweep (``tests/test_compositions.py``): one tiny model under two 2-way mesh axes
on 4 ranks, with at most one modifier, trained for two optimizer steps as the recipes train (``loop.train_step``:
the recipes' loss choice, token-weighted micro batches, CP's batch sharding, the pipeline schedule; then gradient
clipping and an SGD step: linear in the gradients, so the second step compares the layouts' first-step differences as
they are, where Adam's normalization would turn a sign difference of a near-zero gradient into a full step), against plain transformers in this process on the whole batch.

A cell answers one of two ways: parity (the loss of each step and every gradient of the trainable parameters after
each backward, ``full_tensor`` of the sharded ones) or a refusal raised while the context is built or the model is
loaded, before any step. Anything else (an error in a step) propagates: the sweep reports it as a failure.
"""

from __future__ import annotations

import tempfile
import zlib
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from automodel import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.compile import eager_block_classes
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import full_tensor
from automodel.loading.placements import local_indices
from automodel.loading.sources import select
from automodel.training.loop import train_step
from automodel.training.loss import choose_loss
from automodel.training.optim import clip_grad_norm
from tests.tiny_models import token_batch

#: The sweep's models: model type and config overrides of ``tests.causal_lm_zoo.tiny_config`` (4 layers, so that
#: two pipeline stages get two each), or the Nemotron-H sidecar's tiny config.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("llama", {}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "sliding": ("gemma3_text", {}),  # sliding-window and full attention layers, window 8 < the 16-token batch
    "moe": ("qwen3_moe", {}),
    "hybrid": ("nemotron_h", {}),
}
#: The 2-way axes and the ``MeshContext.build`` keywords of each (FSDP2: the 2 ranks left to ``dp_shard``).
AXES: dict[str, dict[str, Any]] = {
    "fsdp2": {},
    "hsdp": {"dp_replicate_size": 2},
    "tp": {"tp_size": 2},
    "cp": {"cp_size": 2},
    "ep": {"ep_size": 2},
    "pp": {"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2},
}
ROWS, LENGTH, STEPS, LR, MAX_NORM = 8, 16, 2, 0.1, 1.0
_CHECKPOINTS: dict[str, str] = {}


def plain_model(model: str) -> torch.nn.Module:
    """The plain transformers model of sweep model ``model`` (fp32, train mode, seed 0)."""
    model_type, overrides = MODELS[model]
    if model_type == "nemotron_h":
        from tests.cases.sidecar_nemotron_h import tiny_config as nemotron_h_config

        config = nemotron_h_config(**overrides)
    else:
        from tests.causal_lm_zoo import tiny_config

        config = tiny_config(model_type, num_hidden_layers=4, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def layout_of(axes: tuple[str, str], modifier: str) -> dict[str, Any]:
    """``MeshContext.build`` keywords of a cell."""
    layout: dict[str, Any] = {"strategy": "fsdp2"}
    for axis in axes:
        layout.update(AXES[axis])
    if modifier == "sp":
        layout["sequence_parallel"] = True
    if modifier == "ac":
        layout["activation_checkpointing"] = True
    if modifier == "compile":
        layout["compile"] = True
    return layout


def _checkpoint(model: str) -> str:
    """``model`` saved once per rank pool (rank 0 writes; every rank reads the same directory)."""
    if model not in _CHECKPOINTS:
        paths = [tempfile.mkdtemp(prefix=f"sweep-{model}-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(paths, src=0)
        if dist.get_rank() == 0:
            plain_model(model).save_pretrained(paths[0])
        dist.barrier()
        _CHECKPOINTS[model] = paths[0]
    return _CHECKPOINTS[model]


def _lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"])


def composition_cell(model: str, axes: tuple[str, str], modifier: str) -> dict[str, Any]:
    """One cell on this rank: ``{"refused": message}``, or the worst loss and gradient differences over the steps
    (``loss``, ``grad`` and its parameter ``worst_grad``), the trainable parameters left without a gradient
    (``no_grad``) and the block classes whose compilation failed, with the reason (``eager_blocks``)."""
    directory = _checkpoint(model)
    layout = layout_of(axes, modifier)
    lora = _lora_config() if modifier == "lora" else None
    try:
        context = MeshContext.build(**layout)
        parallel = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, peft_config=lora)
    except (ValueError, NotImplementedError, TypeError) as refusal:
        return {"refused": f"{type(refusal).__name__}: {refusal}"}
    parallel.train()
    reference = plain_model(model)
    if lora is not None:
        from peft import get_peft_model

        reference = get_peft_model(reference, lora).train()
        _same_adapters(parallel, reference)
    plain = {
        name.removeprefix("base_model.model."): p for name, p in reference.named_parameters(remove_duplicate=False)
    }
    loss_fn, _ = choose_loss("auto", 4096, parallel)
    micro_batches = _micro_batches(context, accumulation=2 if modifier == "accum" else 1)
    batch = token_batch(ROWS, LENGTH)
    trainable = [p for p in parallel.parameters() if p.requires_grad]
    # A pipeline stage may hold no adapter (LoRA on attention; Nemotron-H's second stage has none): an empty group.
    optimizer = torch.optim.SGD([{"params": trainable}], lr=LR)
    plain_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    worst_loss, worst_grad, worst_name = 0.0, 0.0, ""
    for _ in range(STEPS):
        loss = train_step(parallel, micro_batches, context, loss_fn)
        expected = reference(input_ids=batch, labels=batch).loss
        expected.backward()
        worst_loss = max(worst_loss, abs(loss.item() - expected.item()))
        for name, param in parallel.named_parameters():
            if not param.requires_grad or param.grad is None:
                continue
            difference = (full_tensor(param.grad) - plain[name].grad).abs().max().item()
            if difference >= worst_grad:
                worst_grad, worst_name = difference, name
        missing = [
            name
            for name, param in parallel.named_parameters()
            if param.requires_grad and param.grad is None and plain[name].grad is not None
        ]
        clip_grad_norm(parallel.parameters(), MAX_NORM)  # as the recipes: the frozen ones too
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], MAX_NORM)
        optimizer.step()
        plain_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plain_optimizer.zero_grad(set_to_none=True)
    modules = list(parallel.stages) if isinstance(parallel, PipelinedModel) else [parallel]
    eager = {f"{name}: {reason}" for module in modules for name, reason in eager_block_classes(module).items()}
    return {"loss": worst_loss, "grad": worst_grad, "worst_grad": worst_name, "no_grad": missing, "eager_blocks": eager}


def _micro_batches(context: MeshContext, accumulation: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's rows of the global batch, in ``accumulation`` micro batches."""
    batch = token_batch(ROWS, LENGTH)
    rows = ROWS // context.dp_size
    mine = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
    return [
        {"input_ids": part, "labels": part.clone(), "num_tokens": torch.tensor(part.numel())}
        for part in mine.chunk(accumulation)
    ]


def _same_adapters(parallel: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every adapter weight drawn from a generator seeded by its name, the same in both models, whichever stage holds
    it; ``lora_B`` non-zero (peft starts it at zero, which would leave ``lora_A`` without a gradient)."""
    plain = {name.removeprefix("base_model.model."): p for name, p in reference.named_parameters()}
    with torch.no_grad():
        for name, param in plain.items():
            if "lora_" in name:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, param in parallel.named_parameters():
            if "lora_" in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(select(plain[name].detach(), local_indices(param)))
