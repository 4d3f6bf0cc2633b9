"""Rank-side cases for the DeepSeek-V4 sidecar (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import FSDP2Config, MeshContext, ModelParallelizer
from tests.parity import compare_with_reference, local_rows
from tests.tiny_models import VOCAB, token_batch

BF16_LAYOUT = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def tiny_deepseek_v4_config() -> DeepseekV4Config:
    """Three layers covering every block type: sliding / compressed-sparse (with its indexer) / heavily-compressed
    attention, hash-routed then top-k MoE, mHC with 2 streams; 4 experts (EP=2 and TP=2 divide them)."""
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        # The 8-token batch closes two CSA windows and one HCA window.
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=2,
        hc_sinkhorn_iters=5,
        sliding_window=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        tie_word_embeddings=False,
    )


def save_deepseek_v4_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V4 in several shards; every float32-kept parameter (zeros / ones at init) and the hash
    routing table are randomised so that a wrong shard or a lost dtype shows in the outputs."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_deepseek_v4_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == torch.float32 and name.rsplit(".", 1)[-1] in {"weight", "scale", "hc_scale"}:
                param.add_(0.1 * torch.randn_like(param))
            elif name.rsplit(".", 1)[-1] in {"sinks", "position_bias", "base", "hc_base"}:
                param.normal_(0.0, 0.5)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                experts = torch.stack([torch.randperm(4)[:2] for _ in range(VOCAB)])
                layer.mlp.gate.tid2eid.copy_(experts)
    model.save_pretrained(directory, max_shard_size="40KB")
    return directory


def kept_parameter_rule() -> dict[str, list[str]]:
    """The parameters the sidecar keeps in float32 units, next to those transformers keeps in float32 (by
    ``_keep_in_fp32_modules_strict`` path, and by the dtype a bf16 model gets: at construction from transformers 5.24
    on, while loading through the model's dtype plan before)."""
    from automodel._compat.transformers import build_glob_alternation, dtype_plan
    from model_sidecars.deepseek_v4.parallelization import _fp32_kept_parameters

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM._from_config(tiny_deepseek_v4_config(), dtype=torch.bfloat16)
    rule = _fp32_kept_parameters(model)
    plan = dtype_plan(model, torch.bfloat16)
    loaded_fp32 = build_glob_alternation(list(plan))[0] if plan else None
    return {
        "sidecar": sorted(name for name, p in model.named_parameters() if id(p) in rule),
        "by_path": sorted(name for name, _ in model.named_parameters() if _is_fp32_kept(name)),
        "by_dtype": sorted(
            name
            for name, p in model.named_parameters()
            if p.dtype == torch.float32 or (loaded_fp32 is not None and loaded_fp32.search(name))
        ),
    }


def _record_shard_calls(parallelizer: ModelParallelizer, seen: list[str]) -> None:
    """Shadow the instance's primitive so the names of the modules it shards are recorded (undone by ``del``)."""
    primitive = type(parallelizer)._fully_shard_module

    def recording(module: nn.Module, **kwargs: Any) -> nn.Module:
        seen.append(f"{type(module).__name__}@{kwargs['mesh'].mesh_dim_names}")
        return primitive(parallelizer, module, **kwargs)

    parallelizer._fully_shard_module = recording


def loaded_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load through ``NeMoAutoModelForCausalLM`` for ``layout`` and compare with plain transformers (fp32)."""
    from model_sidecars.deepseek_v4.parallelization import PARALLELIZER

    seen: list[str] = []
    _record_shard_calls(PARALLELIZER, seen)
    try:
        context = MeshContext.build(**layout)
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    finally:
        del PARALLELIZER._fully_shard_module
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.train()
    reference.train()
    result = compare_with_reference(reference, model, context, token_batch())
    return {
        **result,
        "sidecar": type(model).parallelizer is PARALLELIZER,
        "shard_calls": seen,
        "fp32_units": sorted(_fp32_units(model)),
    }


def _fp32_units(model: nn.Module) -> list[str]:
    """Names of the FSDP units whose mixed-precision policy computes in float32."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._mp_policy.param_dtype == torch.float32
    ]


def _record_compute_dtypes(model: nn.Module) -> dict[str, str]:
    """Register hooks recording each parameter's dtype as forward sees it (after FSDP has gathered it)."""
    seen: dict[str, str] = {}
    for module_name, module in model.named_modules():
        names = [name for name, _ in module.named_parameters(recurse=False)]
        if not names:
            continue

        def record(mod: nn.Module, args: Any, prefix: str = module_name, names: list[str] = names) -> None:
            for name in names:
                seen.setdefault(f"{prefix}.{name}", str(getattr(mod, name).dtype))

        module.register_forward_pre_hook(record)
    return seen


def _is_fp32_kept(name: str) -> bool:
    kept = DeepseekV4ForCausalLM._keep_in_fp32_modules_strict
    return any(part in kept for part in name.split("."))


def _local_rows(context: MeshContext, batch: torch.Tensor) -> torch.Tensor:
    return batch[local_rows(context, batch.shape[0])]


def bf16_step(checkpoint: str) -> dict[str, Any]:
    """One bf16 mixed-precision training step with the sidecar; what each parameter is stored and computed in."""
    context = MeshContext.build(BF16_LAYOUT)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.bfloat16).train()
    compute = _record_compute_dtypes(model)
    batch = _local_rows(context, token_batch())
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads_finite = all(
        torch.isfinite(p.grad.full_tensor()).all().item() for p in model.parameters() if p.grad is not None
    )
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():
        ref_loss = reference(input_ids=batch, labels=batch).loss.item()
    stored = {name: str(p.dtype) for name, p in model.named_parameters()}
    kept = {name for name in stored if _is_fp32_kept(name)}
    return {
        "loss": loss.item(),
        "ref_loss": ref_loss,
        "loss_finite": math.isfinite(loss.item()),
        "grads_finite": grads_finite,
        "params_finite": all(torch.isfinite(p.full_tensor().float()).all().item() for p in model.parameters()),
        "n_kept": len(kept),
        "stored_kept": sorted({stored[name] for name in kept}),
        "stored_rest": sorted({dtype for name, dtype in stored.items() if name not in kept}),
        "compute_kept": sorted({compute[name] for name in kept}),
        "compute_rest": sorted({dtype for name, dtype in compute.items() if name not in kept}),
        "kept_in_bf16": sorted(name for name in kept if compute[name] != "torch.float32"),
        "n_computed": len(compute),
        "n_params": len(stored),
        "fp32_units": _fp32_units(model),
        "rank": dist.get_rank(),
    }


def default_vs_sidecar(checkpoint: str, dtype: str, use_sidecar: bool) -> dict[str, Any]:
    """Parallelize plain transformers' model (loaded in ``dtype``) for a bf16 mixed-precision step with the default
    ``ModelParallelizer()`` or the sidecar; report the error, or the dtypes the float32-kept parameters compute in."""
    from model_sidecars.deepseek_v4.parallelization import PARALLELIZER

    context = MeshContext.build(BF16_LAYOUT)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).train()
    parallelizer = PARALLELIZER if use_sidecar else ModelParallelizer()
    parallelizer.parallelize(model, context)
    compute = _record_compute_dtypes(model)
    batch = _local_rows(context, token_batch())
    try:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    except AssertionError as exc:  # FSDP2 refuses a unit mixing dtypes in its lazy init, on every rank alike
        return {"error": str(exc)}
    kept = {name for name in compute if _is_fp32_kept(name)}
    return {
        "error": None,
        "loss": loss.item(),
        "compute_kept": sorted({compute[name] for name in kept}),
        "compute_sinks": sorted({dtype for name, dtype in compute.items() if name.endswith("sinks")}),
    }
