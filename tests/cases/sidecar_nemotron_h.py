"""Rank-side cases for the Nemotron-H sidecar (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.runtime import full_tensor
from tests.hook_recorder import recording_hooks
from tests.parity import compare_with_reference
from tests.tiny_models import VOCAB, token_batch

# One block of each kind: Mamba-2, attention, MLP, MoE. Heads (4 query, 2 KV) divide TP=2.
LAYER_TYPES = ["linear_attention", "full_attention", "mlp", "moe"]
# Representative parameters: one per mixer kind, and the output head.
PROBES = {
    "mamba_in_proj": "model.layers.0.mixer.in_proj.weight",
    "attention_q": "model.layers.1.mixer.q_proj.weight",
    "attention_o": "model.layers.1.mixer.o_proj.weight",
    "mlp_up": "model.layers.2.mixer.up_proj.weight",
    "mlp_down": "model.layers.2.mixer.down_proj.weight",
    "experts_up": "model.layers.3.mixer.experts.up_proj",
    "shared_up": "model.layers.3.mixer.shared_experts.up_proj.weight",
    "lm_head": "lm_head.weight",
}


def tiny_config(**overrides: Any) -> PretrainedConfig:
    """A 4-block hybrid Nemotron-H (Mamba-2, attention, MLP, MoE), hidden size 32."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        layers_block_type=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    values.update(overrides)
    return AutoConfig.for_model("nemotron_h", **values)


def save_checkpoint(directory: str, seed: int = 0) -> str:
    """A tiny random Nemotron-H checkpoint in several shards."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).save_pretrained(
        directory, max_shard_size="40KB"
    )
    return directory


def _tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the ``tp`` mesh axis."""
    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return isinstance(param.placements[param.device_mesh.mesh_dim_names.index("tp")], Shard)


def _facts(model: nn.Module) -> dict[str, Any]:
    from model_sidecars.nemotron_h.parallelization import PARALLELIZER

    params = dict(model.named_parameters())
    return {
        "parallelizer_is_sidecar": getattr(type(model), "parallelizer", None) is PARALLELIZER,
        "tp_sharded": sorted(key for key, name in PROBES.items() if _tp_sharded(params[name])),
        "checkpointed": sorted(n for n, m in model.named_modules() if getattr(m, "_automodel_checkpointed", False)),
        "fsdp_units": sorted(n or "<root>" for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
    }


def loaded_parity(checkpoint: str, layout: dict[str, Any], tp_plan: dict[str, str] | None = None) -> dict[str, Any]:
    """Load through the sidecar for ``layout`` (with a user ``tp_plan``, if given) and compare logits, loss and
    gradients with plain transformers; record which of the sidecar's hooks ran."""
    from model_sidecars.nemotron_h.parallelization import PARALLELIZER

    context = MeshContext.build(**layout)
    with recording_hooks(PARALLELIZER, "_apply", "_apply_fsdp_sharding") as hooks:
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, tp_plan=tp_plan).train()
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).train()
    facts = _facts(model)
    return {**facts, "hooks": hooks, **compare_with_reference(reference, model, context, token_batch())}


def transformers_fp32(checkpoint: str) -> list[str]:
    """The parameters plain transformers keeps in fp32 when it loads ``checkpoint`` in bf16: the MoE router weight
    from transformers 5.24 on (5.23 builds it in the model's dtype)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    return sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)


def bf16_step(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load in bf16 (the MoE router stays fp32 where transformers builds it so) for ``layout`` with FSDP2 mixed
    precision; one forward / backward. Reports the FSDP units that mix dtypes and whether the step finished."""
    from torch.distributed.fsdp import FSDPModule

    from automodel.distributed import FSDP2Config

    strategy = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    context = MeshContext.build(strategy, **layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.bfloat16).train()
    mixed = [
        name
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
        and (group := module._get_fsdp_state()._fsdp_param_group) is not None
        and len({p.sharded_param.dtype for p in group.fsdp_params}) > 1
    ]
    batch = token_batch(batch_size=4)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads_finite = all(
        torch.isfinite(full_tensor(p.grad)).all().item() for p in model.parameters() if p.grad is not None
    )
    return {
        "mixed_units": mixed,
        "loss_finite": bool(torch.isfinite(loss).item()),
        "grads_finite": grads_finite,
        "fp32": sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32),
        "experts_unit": isinstance(model.get_submodule("model.layers.3.mixer.experts"), FSDPModule),
        "transformers_fp32": transformers_fp32(checkpoint),
    }


def refusal(checkpoint: str, layout: dict[str, Any], tp_plan: dict[str, str] | None = None) -> str:
    """The error message loading ``checkpoint`` for ``layout`` raises (empty when it loads)."""
    context = MeshContext.build(**layout)
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, tp_plan=tp_plan)
    except ValueError as error:
        return str(error)
    return ""


def default_versus_sidecar(checkpoint: str) -> dict[str, Any]:
    """TP=2 + activation checkpointing with the default ``ModelParallelizer()`` and with the sidecar, same model."""
    from model_sidecars.nemotron_h.parallelization import PARALLELIZER

    layout = {"strategy": "fsdp2", "tp_size": 2, "activation_checkpointing": True}
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    results = {}
    for name, parallelizer in (("default", ModelParallelizer()), ("sidecar", PARALLELIZER)):
        context = MeshContext.build(**layout)
        model = parallelizer.parallelize(copy.deepcopy(reference), context)
        facts = _facts(model)
        results[name] = {"tp_sharded": facts["tp_sharded"], "checkpointed": facts["checkpointed"]}
    return results


def bf16_default_versus_sidecar(checkpoint: str) -> dict[str, Any]:
    """Loaded in bf16 (the MoE router stays fp32 where transformers builds it so) with FSDP2 mixed precision: one
    forward / backward with the default ``ModelParallelizer()`` and with the sidecar."""
    from torch.distributed.fsdp import FSDPModule

    from automodel.distributed import FSDP2Config
    from model_sidecars.nemotron_h.model import NemotronHForCausalLM
    from model_sidecars.nemotron_h.parallelization import PARALLELIZER

    layout = {"strategy": FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    source = NemotronHForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    batch = token_batch(batch_size=2)
    results = {}
    for name, parallelizer in (("default", ModelParallelizer()), ("sidecar", PARALLELIZER)):
        model = parallelizer.parallelize(copy.deepcopy(source), MeshContext.build(**layout))
        mixed = []
        for unit_name, module in model.named_modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None and len({p.sharded_param.dtype for p in group.fsdp_params}) > 1:
                mixed.append(unit_name)
        try:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            error = "" if torch.isfinite(loss) else "loss is not finite"
        except AssertionError as exc:  # FSDP2's own check on a unit's first forward
            error = str(exc)
        fp32 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)
        results[name] = {"mixed_units": mixed, "error": error, "fp32": fp32}
    results["transformers_fp32"] = transformers_fp32(checkpoint)
    return results
