"""Rank-side cases for quantized checkpoints (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

from automodel import MeshContext, ModelParallelizer, NeMoAutoModelForCausalLM
from automodel.distributed.runtime import full_tensor
from automodel.loading import load_checkpoint, materialize, plan_checkpoint
from automodel.loading.placements import local_indices
from automodel.loading.quantized import BlockScaledFloat8, Mxfp4, pop_quantization_scheme
from automodel.loading.sharded_loader import state_tensors
from automodel.loading.sources import Concatenated, Source, Stacked, StoredTensor
from tests.parity import compare_with_reference
from tests.quantized_checkpoints import dequantized_path
from tests.tiny_models import token_batch


def reference_model(checkpoint: str, reference: str, dtype: torch.dtype = torch.float32):
    """Plain single-process transformers: loading the quantized checkpoint itself with its CPU dequantization
    (``"transformers"``), or the unquantized twin holding the values the codes mean (``"dequantized"``)."""
    if reference == "dequantized":
        return AutoModelForCausalLM.from_pretrained(dequantized_path(checkpoint), dtype=dtype)
    config = AutoConfig.from_pretrained(checkpoint)
    options = {}
    if config.quantization_config["quant_method"] == "mxfp4":
        options["quantization_config"] = Mxfp4Config(dequantize=True)  # transformers' CPU path for MXFP4
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, **options)


def quantized_parity(checkpoint: str, reference: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load the quantized ``checkpoint`` parallelized for ``layout`` (fp32): its weights (``full_tensor()``), then
    logits, loss and every gradient against the plain reference."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.float32)
    ref = reference_model(checkpoint, reference)
    ref_params = dict(ref.named_parameters())
    weights = max((full_tensor(p.detach()) - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
    facts = {
        "weights": weights,
        "quantization_config": hasattr(model.config, "quantization_config"),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
    }
    model.train()
    ref.train()
    return {**facts, **compare_with_reference(ref, model, context, token_batch())}


def bf16_weights(checkpoint: str, layout: dict[str, Any]) -> float:
    """The largest difference of the bf16 weights against transformers' own bf16 dequantization."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.bfloat16)
    ref = dict(reference_model(checkpoint, "transformers", torch.bfloat16).named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # transformers 5.23 leaves the tensors a checkpoint stores unquantized (embeddings, norms: fp32 here) in their
    # stored dtype inside a bf16 model; 5.24 casts them to bf16, which is what a bf16 model holds.
    return max(
        (full_tensor(p.detach()).float() - ref[n].to(torch.bfloat16).float()).abs().max().item()
        for n, p in model.named_parameters()
    )


def quantized_bytes(checkpoint: str, layout: dict[str, Any]) -> dict[str, int]:
    """What this rank read (the loader's own accounting) against the least it must read: the stored codes of its
    shards (fp8: a byte an element, MXFP4: half) plus the scales of the blocks that cover them, and the other
    tensors' stored bytes."""
    context = MeshContext.build(**layout)
    config = AutoConfig.from_pretrained(checkpoint)
    scheme = pop_quantization_scheme(config)
    model = NeMoAutoModelForCausalLM._build_on_meta(config, torch.float32, None, False)
    plan = plan_checkpoint(model, checkpoint, quantization=scheme)
    model = ModelParallelizer().parallelize(model, context)
    materialize(model, "cpu")
    sources = dict(plan.keys.sources)
    report = load_checkpoint(model, plan, progress=False)
    least = sum(
        _least_bytes(sources[name], local_indices(tensor)) for name, tensor in state_tensors(model) if name in sources
    )
    return {"read": report.bytes_read, "least": int(least)}


def _least_bytes(source: Source, indices: list[torch.Tensor]) -> float:
    count = math.prod(len(ix) for ix in indices)
    if isinstance(source, BlockScaledFloat8):
        if math.prod(source.scales.shape) == 1:
            scales = 1
        else:
            scales = math.prod(len(torch.unique(ix // b)) for ix, b in zip(indices, source.block, strict=True))
        return count + scales * _element_size(source.scales)
    if isinstance(source, Mxfp4):
        *lead, columns, rows = indices
        groups = len(torch.unique(columns // 32))
        return count / 2 + math.prod(len(ix) for ix in lead) * len(rows) * groups
    if isinstance(source, StoredTensor):
        return count * _element_size(source)
    if isinstance(source, Stacked):
        rest = indices[: source.dim] + indices[source.dim + 1 :]
        return sum(_least_bytes(source.parts[i], rest) for i in indices[source.dim].tolist())
    if isinstance(source, Concatenated):
        return sum(_least_bytes(source.parts[part], ix) for part, ix, _, _ in source._pieces(indices))
    raise TypeError(f"no byte count for {type(source).__name__}")


def _element_size(source: StoredTensor) -> int:
    return torch.empty((), dtype=source.files.dtype(source.key)).element_size()


def layout_error(checkpoint: str, layout: dict[str, Any]) -> str:
    """The error loading ``checkpoint`` gives on this rank (``"no error"`` if it loads)."""
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build(**layout))
    except (ValueError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def export_and_reload(checkpoint: str, layout: dict[str, Any], directory: str) -> dict[str, Any]:
    """Load the quantized checkpoint parallelized, ``save_pretrained`` it (every rank), and compare plain
    transformers' load of the export with the sharded model."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.float32)
    with torch.no_grad():
        logits = full_tensor(model(input_ids=token_batch()).logits)
    model.save_pretrained(directory)
    exported = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        plain = exported(input_ids=token_batch()).logits
    return {
        "logits": (plain - logits).abs().max().item(),
        "dtypes": sorted({str(p.dtype) for p in exported.parameters()}),
        "quantization_config": hasattr(exported.config, "quantization_config"),
    }
