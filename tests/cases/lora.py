"""Rank-side cases for LoRA adapters on the FSDP2 path (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from automodel import MeshContext, NeMoAutoModelForCausalLM
from automodel.distributed.runtime import full_tensor
from automodel.loading.placements import local_indices
from automodel.loading.sources import select
from automodel.lora import merge_lora
from tests.tiny_models import token_batch

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """LoRA through from_pretrained (sharded) vs peft's get_peft_model on plain transformers with the same adapter
    values: logits, loss and every adapter gradient; then the merge keeps the logits."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, peft_config=LORA).train()
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), LORA).train()
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    batch = token_batch()
    with torch.no_grad():
        initial = (full_tensor(model(input_ids=batch).logits) - base(input_ids=batch).logits).abs().max().item()
        # Non-zero lora_B (peft starts it at zero) so the adapters change the output; the same values in both.
        generator = torch.Generator().manual_seed(3)
        ref_params = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}
        for name, param in model.named_parameters():
            full = full_tensor(param)
            if "lora_B" in name:
                full = torch.randn(full.shape, generator=generator) * 0.1
                _local(param).copy_(select(full, local_indices(param)))
            ref_params[name].copy_(full)
    rows = batch.shape[0] // context.dp_size
    mine = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
    out, ref = model(input_ids=mine, labels=mine), reference(input_ids=batch, labels=batch)
    out.loss.backward()
    ref.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=context.mesh("dp").get_group())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    grads = max(
        (full_tensor(p.grad) - ref_params[n].grad).abs().max().item()
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    with torch.no_grad():
        before = full_tensor(model(input_ids=batch).logits)
        merge_lora(model)
        after = full_tensor(model(input_ids=batch).logits)
    return {
        "initial": initial,
        "logits": (full_tensor(out.logits) - ref.logits[context.mesh("dp").get_local_rank() * rows :][:rows])
        .abs()
        .max()
        .item(),
        "loss": (loss / context.dp_size - ref.loss.detach()).abs().item(),
        "grad": grads,
        "trainable": sorted(trainable),
        "frozen_grads": frozen_grads,
        "merged": (after - before).abs().max().item(),
        "names_after_merge": sorted(n for n, _ in model.named_parameters())
        == sorted(n for n, _ in base.named_parameters()),
    }


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def lora_layout_error(checkpoint: str, layout: dict[str, Any]) -> str:
    """The error LoRA gives with a layout it does not support."""
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build(**layout), peft_config=LORA)
    except ValueError as error:
        return str(error)
    return "no error"
