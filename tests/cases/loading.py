"""Rank-side cases for ``NeMoAutoModelForCausalLM`` (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext, ModelParallelizer
from tests.parity import compare_with_reference
from tests.tiny_models import token_batch


def loaded_parity(checkpoint: str, layout: dict[str, Any] | None) -> dict[str, Any]:
    """Load ``checkpoint`` parallelized for ``layout`` and compare with plain transformers in one process."""
    context = MeshContext.build(**layout) if layout is not None else None
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    facts = {
        "on_meta": [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta],
        "buffers": max(
            ((b - dict(reference.named_buffers())[n]).abs().max().item() for n, b in model.named_buffers()),
            default=0.0,
        ),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "training": model.training,
    }
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if reference.config.get_text_config().tie_word_embeddings:
        facts["tied"] = embeddings.weight is head.weight
    if context is None:
        with torch.no_grad():
            batch = token_batch()
            facts["logits"] = (model(batch).logits - reference(batch).logits).abs().max().item()
        return facts
    model.train()
    reference.train()
    return {**facts, **compare_with_reference(reference, model, context, token_batch())}


def bytes_read_per_rank(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """How much of the checkpoint each rank reads (the loader's own accounting) against the total stored bytes."""
    from automodel.loading import load_checkpoint, materialize, plan_checkpoint
    from automodel.loading.checkpoint_files import open_checkpoint

    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM._build_on_meta(_config(checkpoint), torch.float32, None, False)
    plan = plan_checkpoint(model, checkpoint)
    model = ModelParallelizer().parallelize(model, context)
    materialize(model, "cpu")
    report = load_checkpoint(model, plan, progress=False)
    files = open_checkpoint(checkpoint)
    total = sum(files.read_slice(key, tuple(slice(0, n) for n in files.shape(key))).nbytes for key in files.keys())
    local = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters())
    return {"read": report.bytes_read, "total": total, "local": local}


def _config(checkpoint: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def from_config_matches_seed(layout: dict[str, Any], architecture: str, seed: int) -> dict[str, Any]:
    """``from_config(config, seed=s, init="exact")`` weights equal plain transformers' after ``torch.manual_seed(s)``."""
    from automodel.distributed.runtime import full_tensor
    from tests.tiny_models import tiny_config

    config = tiny_config(architecture)
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_config(config, mesh_context=context, seed=seed, init="exact")
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(config)
    ref = dict(reference.named_parameters())
    diffs = {name: (full_tensor(p) - ref[name]).abs().max().item() for name, p in model.named_parameters()}
    buffers = {
        name: (b - dict(reference.named_buffers())[name]).abs().max().item() for name, b in model.named_buffers()
    }
    return {"weights": max(diffs.values()), "buffers": max(buffers.values(), default=0.0), "count": len(diffs)}


def from_config_weights(layout: dict[str, Any] | None, architecture: str, seed: int) -> dict[str, Any] | None:
    """``from_config(config, seed=s)`` (the default per-module init) for ``layout`` (None: one process): on rank 0,
    every parameter and buffer as a full tensor, and what stayed on the meta device."""
    import torch.distributed as dist

    from automodel.distributed.runtime import full_tensor
    from tests.tiny_models import tiny_config

    context = MeshContext.build(**layout) if layout is not None else None
    model = NeMoAutoModelForCausalLM.from_config(tiny_config(architecture), mesh_context=context, seed=seed)
    tensors = {name: full_tensor(t).detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {
        "tensors": tensors,
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "on_meta": [name for name, t in tensors.items() if t.is_meta],
    }


def greedy_completions(
    checkpoint: str, layout: dict[str, Any] | None, prompts: list[str], tp_plan: dict[str, str] | None = None
) -> list[str]:
    """Greedy chat completions of ``prompts`` from the checkpoint loaded for ``layout`` (None: plain transformers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if layout is None:
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    else:
        context = MeshContext.build(**layout)
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, tp_plan=tp_plan)
    completions = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)
        completions.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return completions


def registry_sidecar_is_used(checkpoint: str) -> dict[str, Any]:
    """An architecture registered in ``model_sidecars`` loads as the sidecar class, through its parallelizer."""
    import model_sidecars
    from tests.cases.sidecar_model import CountingParallelizer

    model_sidecars.SIDECAR_CLASSES["LlamaForCausalLM"] = "tests.cases.sidecar_model.SidecarLlamaForCausalLM"
    CountingParallelizer.units.clear()
    try:
        context = MeshContext.build("fsdp2")
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    finally:
        del model_sidecars.SIDECAR_CLASSES["LlamaForCausalLM"]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        batch = token_batch()
        rows = batch.shape[0] // context.dp_size
        local = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
        logits = (model(local).logits - reference(local).logits).abs().max().item()
    return {
        "mro": [cls.__name__ for cls in type(model).__mro__],
        "units": list(CountingParallelizer.units),
        "logits": logits,
    }


def loaded_weights(checkpoint: str, layout: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Largest difference between the loaded weights (as full tensors) and plain transformers' for ``dtype``."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=dtype)
    reference = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).named_parameters())
    diffs, dtypes = [], set()
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        dtypes.add(str(full.dtype))
        diffs.append((full.float() - reference[name].float()).abs().max().item())
    return {
        "max_diff": max(diffs),
        "dtypes": sorted(dtypes),
        "reference": sorted({str(p.dtype) for p in reference.values()}),
    }


def experts_finer_than_one_per_rank(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """``loaded_parity`` for a MoE checkpoint with fewer local experts than the ranks that shard them, plus the
    FSDP2 shard dims of the routed experts' weights (dim 1 or later: each rank holds a slice of every local expert,
    not a whole expert padded out) and the bytes each rank read against what it holds."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    dims = set()
    for name, param in model.named_parameters():
        if ".experts." in name and param.ndim == 3 and isinstance(param, DTensor):
            mesh_dims = [d for d, axis in enumerate(param.device_mesh.mesh_dim_names) if axis != "ep"]
            dims |= {param.placements[d].dim for d in mesh_dims if param.placements[d].is_shard()}
    model.train()
    reference.train()
    return {"expert_shard_dims": sorted(dims), **compare_with_reference(reference, model, context, token_batch())}


def plain_state_dict_and_resize(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """``load_state_dict`` of plain transformers' (unsharded) state dict of other weights into the parallelized model:
    its logits become that model's; ``resize_token_embeddings`` is refused where the weights are sharded."""
    other = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(0.5)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build(**layout)).eval()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        logits = model(input_ids=token_batch()).logits
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        difference = (full - other(input_ids=token_batch()).logits).abs().max().item()
    try:
        model.resize_token_embeddings(200)
        resize = "resized"
    except NotImplementedError as error:
        resize = str(error)
    return {"logits": difference, "resize": resize}
