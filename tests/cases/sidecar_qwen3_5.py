"""Rank-side cases for the Qwen3.5 sidecar (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import FSDP2Config, MeshContext, ModelParallelizer
from automodel.distributed.runtime import full_tensor
from tests.hook_recorder import recording_hooks
from tests.parity import compare_with_reference
from tests.tiny_models import VOCAB, token_batch

# Parameters the sidecar model class keeps fp32 (GatedDeltaNet's decay and norm) in layer 0, the linear-attention one.
FP32_PARAMETERS = [
    "model.layers.0.linear_attn.A_log",
    "model.layers.0.linear_attn.dt_bias",
    "model.layers.0.linear_attn.norm.weight",
]
BF16_LAYOUT = {"strategy": FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


# The MoE variant's routed experts (4, top-2: EP=2 divides them) and shared expert, in every layer.
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def tiny_config(moe: bool = False, **overrides: Any) -> PretrainedConfig:
    """A 2-layer Qwen3.5 text model: GatedDeltaNet, then full attention (4 query / 2 KV heads, TP=2 divides); with
    ``moe``, Qwen3.5-MoE (routed experts in every layer)."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    values.update(MOE_SIZES if moe else {})
    values.update(overrides)
    return AutoConfig.for_model("qwen3_5_moe_text" if moe else "qwen3_5_text", **values)


def save_checkpoint(directory: str, seed: int = 0, moe: bool = False) -> str:
    """A tiny random Qwen3.5 (or Qwen3.5-MoE) text checkpoint (fp32) in several shards."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(moe), dtype=torch.float32).save_pretrained(
        directory, max_shard_size="40KB"
    )
    return directory


def _unit_dtypes(model: nn.Module) -> dict[str, list[str]]:
    """The dtypes of the parameters each FSDP unit manages, by unit (module name, or a list unit's first member)."""
    names = {module: name for name, module in model.named_modules()}
    units = {}
    for module, name in names.items():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and name not in units:
            units[name or "<root>"] = sorted({str(p.sharded_param.dtype) for p in group.fsdp_params})
    return units


def loaded_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load through the sidecar for ``layout`` (fp32) and compare with plain transformers."""
    from model_sidecars.qwen3_5.parallelization import PARALLELIZER

    context = MeshContext.build(**layout)
    with recording_hooks(PARALLELIZER, "_apply_fsdp_sharding") as hooks:
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context).train()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).train()
    facts = {
        "hooks": hooks,
        "parallelizer_is_sidecar": getattr(type(model), "parallelizer", None) is PARALLELIZER,
        "tp_sharded": sorted(
            name
            for name, p in model.named_parameters()
            if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        ),
    }
    return {**facts, **compare_with_reference(reference, model, context, token_batch())}


def bf16_step(checkpoint: str, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load in bf16 with FSDP2 mixed precision (plus ``layout``), run one forward / backward / AdamW step; report
    dtypes and losses."""
    context = MeshContext.build(**BF16_LAYOUT, **(layout or {}))
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.bfloat16).train()
    batch = token_batch()
    rows = batch.shape[0] // context.dp_size
    local = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    computed = {}
    attention = next(module for name, module in model.named_modules() if name.endswith("linear_attn"))
    attention.register_forward_pre_hook(
        lambda module, args: computed.update(
            {name: str(p.dtype) for name, p in module.named_parameters() if name in ("A_log", "dt_bias", "norm.weight")}
        )
    )
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    grads_finite = all(torch.isfinite(full_tensor(p.grad)).all().item() for p in model.parameters())
    optimizer.step()
    after = model(input_ids=local, labels=local).loss
    # The same bf16 model in one process (the fp32 parameters kept, computed without FSDP's bf16 cast).
    reference = type(model).from_pretrained(checkpoint, dtype=torch.bfloat16)
    reference_loss = reference(input_ids=local, labels=local).loss
    return {
        "fp32": sorted(name for name, p in model.named_parameters() if p.dtype == torch.float32),
        "other_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32}),
        "loss": loss.item(),
        "loss_after_step": after.item(),
        "reference_loss": reference_loss.item(),
        "finite": math.isfinite(loss.item()) and math.isfinite(after.item()) and grads_finite,
        "unit_dtypes": _unit_dtypes(model),
        "computed_in": computed,
    }


def default_versus_sidecar_bf16(checkpoint: str) -> dict[str, Any]:
    """The same bf16-with-fp32-parameters model, parallelized by ``ModelParallelizer()`` and by the sidecar."""
    from model_sidecars.qwen3_5.model import Qwen3_5ForCausalLM
    from model_sidecars.qwen3_5.parallelization import PARALLELIZER

    source = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    batch = token_batch(batch_size=2)
    results = {}
    for name, parallelizer in (("default", ModelParallelizer()), ("sidecar", PARALLELIZER)):
        model = parallelizer.parallelize(copy.deepcopy(source), MeshContext.build(**BF16_LAYOUT))
        mixed = sorted(unit for unit, dtypes in _unit_dtypes(model).items() if len(dtypes) > 1)
        try:
            model(input_ids=batch, labels=batch).loss.backward()
            error = ""
        except AssertionError as exc:  # FSDP2's own check on a unit's first forward
            error = str(exc)
        results[name] = {"mixed_units": mixed, "error": error}
    return results
