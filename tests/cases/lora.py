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

# Colwise (q_proj, v_proj) and rowwise (down_proj) base layers under TP.
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
# The dense modules of a MoE model (its routed experts are fused parameters, not modules).
MOE_LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
# Every linear layer but the output head (peft's "all-linear"): a MoE model's routers and shared experts included.
ALL_LINEAR = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
CONFIGS = {"dense": LORA, "moe": MOE_LORA, "all_linear": ALL_LINEAR}


def lora_parity(checkpoint: str, layout: dict[str, Any], targets: str = "dense") -> dict[str, Any]:
    """LoRA through from_pretrained (sharded) vs peft's get_peft_model on plain transformers with the same adapter
    values: logits, loss and every adapter gradient; then the merge keeps the logits."""
    config = CONFIGS[targets]
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, peft_config=config).train()
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), config).train()
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


def _random_lora_b(model: torch.nn.Module) -> None:
    """Non-zero lora_B factors (peft starts them at zero), the same values on every rank, so an adapter changes the
    outputs."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                full = torch.randn(param.shape, generator=generator) * 0.1
                _local(param).copy_(select(full, local_indices(param)))


def save_adapter(checkpoint: str, layout: dict[str, Any], directory: str) -> dict[str, Any]:
    """Load with new adapters for ``layout``, give them values, save the adapter on every rank; the sharded model's
    logits (for the round trip) on rank 0."""
    from automodel.lora_checkpoint import save_lora_adapter

    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, peft_config=LORA)
    _random_lora_b(model)
    with torch.no_grad():
        logits = full_tensor(model(input_ids=token_batch()).logits)
    save_lora_adapter(model, directory)
    return {"logits": logits if dist.get_rank() == 0 else None}


def load_adapter(checkpoint: str, layout: dict[str, Any], directory: str) -> dict[str, Any]:
    """Load ``checkpoint`` with the saved adapter for ``layout``; its logits and which parameters train."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, lora_adapter=directory)
    with torch.no_grad():
        logits = full_tensor(model(input_ids=token_batch()).logits)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"logits": logits, "trainable": trainable}


def dropout_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, float]:
    """LoRA dropout in training mode on colwise layers under TP (one data-parallel rank, so the batch is whole):
    with every rank seeded alike, the masks, hence the logits and adapter gradients, are peft's own."""
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj", "gate_proj"])
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, peft_config=config).train()
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), config).train()
    _random_lora_b(model)
    ref_params = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            ref_params[name].copy_(full_tensor(param))
    batch = token_batch()
    torch.manual_seed(11)
    out = model(input_ids=batch, labels=batch)
    torch.manual_seed(11)
    ref = reference(input_ids=batch, labels=batch)
    out.loss.backward()
    ref.loss.backward()
    grads = [
        (full_tensor(p.grad) - ref_params[n].grad).abs().max().item()
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    return {"logits": (full_tensor(out.logits) - ref.logits).abs().max().item(), "grad": max(grads)}


def adapter_bytes(checkpoint: str, layout: dict[str, Any], directory: str) -> dict[str, Any]:
    """Save the adapter of ``layout`` on every rank (the bytes this rank wrote itself), and on rank 0 peft's own
    ``save_pretrained`` of a plain model holding the same factors, for a byte-for-byte comparison."""
    import copy
    import hashlib
    import tempfile
    from pathlib import Path
    from unittest import mock

    from automodel.loading import parallel_export
    from automodel.lora_checkpoint import ADAPTER_WEIGHTS, save_lora_adapter

    model = NeMoAutoModelForCausalLM.from_pretrained(
        checkpoint, mesh_context=MeshContext.build(**layout), peft_config=LORA
    )
    _random_lora_b(model)
    written = []
    real = parallel_export.write_box

    def counted(fd, start, shape, offsets, data):
        written.append(data.numel() * data.element_size())
        real(fd, start, shape, offsets, data)

    with mock.patch.object(parallel_export, "write_box", counted):
        save_lora_adapter(model, directory)
    factors = {name: full_tensor(param.detach()) for name, param in model.named_parameters() if "lora_" in name}
    facts: dict[str, Any] = {"bytes_written": sum(written)}
    if dist.get_rank() == 0:
        plain = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), copy.deepcopy(LORA))
        with torch.no_grad():
            for name, param in plain.base_model.model.named_parameters():
                if name in factors:
                    param.copy_(factors[name])
        reference = Path(tempfile.mkdtemp())
        plain.save_pretrained(reference)

        def digest(folder: Path) -> str:
            return hashlib.sha256((folder / ADAPTER_WEIGHTS).read_bytes()).hexdigest()

        facts["same_bytes"] = digest(Path(directory)) == digest(reference)
        facts["factors"] = len(factors)
    return facts


def merged_export(checkpoint: str, layout: dict[str, Any], options: dict[str, Any], directory: str) -> dict[str, Any]:
    """Adapters of ``options`` with random values (both factors and, with ``lora_bias``, lora_B's bias, seeded by
    name, so every rank and peft agree under any layout), folded with ``merge_lora`` and saved: the export, loaded by
    plain transformers, against peft's ``merge_and_unload`` of the same adapters (rank 0); the other ranks None."""
    import zlib

    config = LoraConfig(r=4, lora_alpha=8, **options)
    model = NeMoAutoModelForCausalLM.from_pretrained(
        checkpoint, mesh_context=MeshContext.build(**layout), peft_config=config
    )
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), config)
    ref_params = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}

    def seeded(name: str, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1

    with torch.no_grad():
        for name, param in model.named_parameters():  # under PP, this rank's stages
            if ".lora_" in name:
                _local(param).copy_(select(seeded(name, param.shape), local_indices(param)))
        for name, param in ref_params.items():
            if ".lora_" in name:
                param.copy_(seeded(name, param.shape))
    merge_lora(model)
    model.save_pretrained(directory)
    if dist.get_rank() != 0:
        return {}
    with torch.no_grad():
        expected = reference.merge_and_unload()(input_ids=token_batch()).logits
        exported = AutoModelForCausalLM.from_pretrained(directory)
        return {"logits": (exported(input_ids=token_batch()).logits - expected).abs().max().item()}


def unmerged_save(checkpoint: str, directory: str) -> str:
    """``save_pretrained`` of a model still carrying adapters: the error each rank gets."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    model = NeMoAutoModelForCausalLM.from_pretrained(
        checkpoint, mesh_context=MeshContext.build("fsdp2"), peft_config=config
    )
    try:
        model.save_pretrained(directory)
    except ValueError as error:
        return str(error)
    return "saved"
