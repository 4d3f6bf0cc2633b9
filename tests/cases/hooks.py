"""Rank-side cases for the sidecar hooks, error paths and helpers of the parallelizer."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from automodel.distributed import (
    MegatronFSDPConfig,
    MeshContext,
    ModelParallelizer,
    fully_shard_by_dtype,
    fully_shard_default,
)
from automodel.distributed.megatron_fsdp import megatron_fsdp_arguments
from automodel.distributed.tensor_parallel import set_user_tp_plan
from tests.parity import compare_with_reference
from tests.tiny_models import build_model, tiny_llama_config, token_batch


class RecordingParallelizer(ModelParallelizer):
    """A sidecar as the product docs show it: only ``_fully_shard_module`` is overridden."""

    def __init__(self) -> None:
        self.sharded: list[str] = []

    def _fully_shard_module(self, module, **kwargs):
        self.sharded.append(type(module).__name__)
        return fully_shard_default(module, **kwargs)


def sidecar_fully_shard_module_is_used(layout: dict[str, Any]) -> dict[str, Any]:
    """Every FSDP unit goes through the sidecar's primitive, and the result still matches plain transformers."""
    context = MeshContext.build(**layout)
    reference = build_model(tiny_llama_config())
    parallelizer = RecordingParallelizer()
    model = parallelizer.parallelize(copy.deepcopy(reference), context)
    units = [type(module).__name__.removeprefix("FSDP") for module in model.modules() if isinstance(module, FSDPModule)]
    result = compare_with_reference(reference, model, context, token_batch())
    return {"sharded": parallelizer.sharded, "fsdp_units": units, **result}


class RefusingParallelizer(ModelParallelizer):
    def _validate_tp_mesh(self, model, tp_mesh):
        raise ValueError(f"this model cannot use TP over {tp_mesh.size()} ranks")


def validate_tp_mesh_can_stop() -> dict[str, Any]:
    """A sidecar's ``_validate_tp_mesh`` raising stops parallelization before anything is sharded."""
    context = MeshContext.build("fsdp2", tp_size=dist.get_world_size())
    model = build_model(tiny_llama_config())
    try:
        RefusingParallelizer().parallelize(model, context)
    except ValueError as error:
        return {"error": str(error), "untouched": not any(isinstance(p, DTensor) for p in model.parameters())}
    return {"error": None}


class FullLayerParallelizer(ModelParallelizer):
    def _use_full_layer_activation_checkpointing(self, model):
        return True


def activation_checkpointing_granularity(full_layers: bool) -> dict[str, Any]:
    """Which modules were checkpointed: whole decoder layers (hook) or their attention / MLP blocks (default)."""
    context = MeshContext.build("fsdp2", activation_checkpointing=True)
    reference = build_model(tiny_llama_config())
    parallelizer = FullLayerParallelizer() if full_layers else ModelParallelizer()
    model = parallelizer.parallelize(copy.deepcopy(reference), context)
    checkpointed = sorted(
        {
            type(module).__name__.removeprefix("FSDP")
            for module in model.modules()
            if getattr(module, "_automodel_checkpointed", False)
        }
    )
    result = compare_with_reference(reference, model, context, token_batch())
    return {"checkpointed": checkpointed, **result}


def parallelize_error(config_overrides: dict[str, Any], layout: dict[str, Any], tp_plan: Any = None) -> str:
    """The message of the error ``parallelize`` raises for this model and layout (every rank must raise)."""
    context = MeshContext.build(**layout)
    model = build_model(tiny_llama_config(**config_overrides))
    if tp_plan == "none":
        model._tp_plan = {}
    parallelizer = ModelParallelizer()
    if isinstance(tp_plan, dict):
        parallelizer._tp_plan = tp_plan
    try:
        parallelizer.parallelize(model, context)
    except (ValueError, NotImplementedError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def derived_plan_parity(layout: dict[str, Any]) -> dict[str, Any]:
    """A Llama whose class declares no TP plan: the plan derived from its module tree, and parity with the plain
    model (logits, loss, every gradient)."""
    context = MeshContext.build(**layout)
    reference = build_model(tiny_llama_config())
    model = copy.deepcopy(reference)
    model._tp_plan = {}
    model = ModelParallelizer().parallelize(model, context)
    return {"plan": dict(model._tp_plan), **compare_with_reference(reference, model, context, token_batch())}


def gpt2_plan_parity(layout: dict[str, Any], plan: dict[str, str] | None) -> dict[str, Any]:
    """A tiny GPT-2 (``Conv1D`` layers, weights stored (in, out)) under ``plan`` (``None``: the one derived from its
    module tree): the plan, the placements of its first block's MLP weights and parity with the plain model; or the
    error ``parallelize`` raises."""
    from transformers import AutoModelForCausalLM

    from tests.causal_lm_zoo import tiny_config

    context = MeshContext.build(**layout)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("gpt2"), dtype=torch.float32)
    model = copy.deepcopy(reference)
    if plan is not None:
        set_user_tp_plan(model, plan)
    try:
        model = ModelParallelizer().parallelize(model, context)
    except ValueError as error:
        return {"error": str(error)}
    placements = {
        name: str(param.placements[-1])
        for name, param in model.named_parameters()
        if name.startswith("transformer.h.0.mlp.")
    }
    batch = token_batch()
    return {
        "plan": dict(model._tp_plan),
        "placements": placements,
        **compare_with_reference(reference, model, context, batch),
    }


def wrong_plan_error(plan: dict[str, str], layout: dict[str, Any]) -> str:
    """The error the first training forward raises for a user's TP plan that leaves a consumer of sharded features
    replicated."""
    context = MeshContext.build(**layout)
    model = build_model(tiny_llama_config())
    set_user_tp_plan(model, plan)
    model = ModelParallelizer().parallelize(model, context)
    try:
        model(input_ids=token_batch(), labels=token_batch()).loss.backward()
    except ValueError as error:
        return str(error)
    return "no error"


def derived_plan_backward(layout: dict[str, Any], planted: str | None) -> str:
    """Two training steps of a Llama under its derived plan; with ``planted``, that parameter's gradient is made
    rank-dependent on the first (as a replicated module computing on its rank's slice would give): the error the
    first backward raises, or "no error"."""
    context = MeshContext.build(**layout)
    model = build_model(tiny_llama_config())
    model._tp_plan = {}
    model = ModelParallelizer().parallelize(model, context)
    if planted is not None:
        rank = dist.get_rank(context.mesh("tp").get_group())
        handle = model.get_parameter(planted).register_hook(lambda grad: grad * (1.0 + rank))
    try:
        for _ in range(2):
            model(input_ids=token_batch(), labels=token_batch()).loss.backward()
            if planted is not None:
                handle.remove()
    except ValueError as error:
        return str(error)
    return "no error"


def forward_error(layout: dict[str, Any], seq_len: int) -> str:
    """The message of the error a forward pass raises (e.g. a sequence SP cannot split)."""
    context = MeshContext.build(**layout)
    model = ModelParallelizer().parallelize(build_model(tiny_llama_config()), context)
    try:
        model(input_ids=token_batch(seq_len=seq_len))
    except ValueError as error:
        return str(error)
    return "no error"


def build_error(layout: dict[str, Any]) -> str:
    """The message of the error ``MeshContext.build`` raises for ``layout``."""
    try:
        MeshContext.build(**layout)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def mesh_facts(layout: dict[str, Any]) -> dict[str, Any]:
    """Sizes read back from the live meshes of a built context."""
    context = MeshContext.build(**layout)
    axes = ("dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")
    facts = {axis: context.size(axis) for axis in axes}
    facts.update(ep=context.ep_size, device_type=context.device_type, world=context.world_size)
    if context.moe_mesh is not None:
        facts["ep_shard"] = context.size("ep_shard")
    return facts


def from_meshes_error(names: tuple[str, ...]) -> str:
    """The message ``MeshContext.from_meshes`` gives for a mesh with these axis names."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (dist.get_world_size(),) + (1,) * (len(names) - 1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        context = MeshContext.from_meshes(mesh)
    except ValueError as error:
        return str(error)
    return f"ok dp_shard={context.dp_shard_size} tp={context.tp_size}"


def megatron_on_cpu() -> dict[str, Any]:
    """Megatron-FSDP: the argument mapping it would receive, and the clear error dispatch gives without CUDA."""
    dense = MeshContext.build("fsdp2")
    context = MeshContext(device_mesh=dense.device_mesh, strategy=MegatronFSDPConfig(zero_dp_strategy=2))
    model = build_model(tiny_llama_config())
    arguments = megatron_fsdp_arguments(model, context)
    try:
        ModelParallelizer().parallelize(model, context)
        error = "no error"
    except RuntimeError as exc:
        error = str(exc)
    return {
        "error": error,
        "untouched": not any(isinstance(p, DTensor) for p in model.parameters()),
        "units": [cls.__name__ for cls in arguments["fsdp_unit_modules"]],
        "dp_shard_dim": arguments["dp_shard_dim"],
        "tp_dim": arguments["tp_dim"],
        "dp_outer_dim": arguments["dp_outer_dim"],
        "zero_dp_strategy": arguments["zero_dp_strategy"],
        "meta_init": arguments["init_model_with_meta_device"],
    }


class MixedDtypeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).to(torch.bfloat16)
        self.gate = nn.Linear(8, 8)  # kept in fp32

    def forward(self, x):
        return self.proj(x.to(torch.bfloat16)).float() + self.gate(x)


def dtype_grouping() -> dict[str, Any]:
    """``fully_shard_by_dtype`` makes every FSDP unit dtype-uniform, so a mixed-dtype block trains under FSDP2."""
    context = MeshContext.build("fsdp2")
    torch.manual_seed(0)
    block = MixedDtypeBlock()
    fully_shard_by_dtype(block, mesh=context.mesh("dp_shard_cp"))
    units = {
        name or "<root>": sorted(_unit_dtypes(module))
        for name, module in block.named_modules()
        if isinstance(module, FSDPModule)
    }
    out = block(torch.randn(2, 8))
    out.sum().backward()
    return {"units": units, "grads": all(p.grad is not None for p in block.parameters())}


def _unit_dtypes(module: nn.Module) -> set[str]:
    owned = set()
    for sub in module.modules():
        if sub is not module and isinstance(sub, FSDPModule):
            continue
        owned |= {str(p.dtype) for p in sub.parameters(recurse=False)}
    return owned


def fail_on_rank(failing_rank: int) -> int:
    """Rank ``failing_rank`` raises; the others wait in a collective that can never finish."""
    if dist.get_rank() == failing_rank:
        raise RuntimeError(f"shard file unreadable on rank {failing_rank}")
    dist.barrier()
    return dist.get_rank()


def rank_id() -> int:
    return dist.get_rank()


class UnitsAndPrimitiveParallelizer(ModelParallelizer):
    """Chooses its own units and primitive, but does not declare the primitive safe on the MoE path."""

    def _apply_fsdp_sharding(self, model, *, mesh, **kwargs):
        return super()._apply_fsdp_sharding(model, mesh=mesh, **kwargs)

    def _fully_shard_module(self, module, **kwargs):
        return fully_shard_default(module, **kwargs)


def path_refusal(parallelizer_name: str, layout: dict[str, Any], architecture: str = "llama") -> str:
    """``"<ErrorType>: <message>"`` of what ``parallelize`` raises for a sidecar on the path ``layout`` selects (a
    Megatron-FSDP layout is built field by field: ``MeshContext.build`` needs CUDA for it), or ``"no error"``."""
    from automodel.distributed import MegatronFSDPConfig
    from tests.tiny_models import tiny_config

    parallelizer = {"units_and_primitive": UnitsAndPrimitiveParallelizer, "recording": RecordingParallelizer}[
        parallelizer_name
    ]()
    if layout.get("strategy") == "megatron_fsdp":
        context = MeshContext(device_mesh=MeshContext.build("fsdp2").device_mesh, strategy=MegatronFSDPConfig())
    else:
        context = MeshContext.build(**layout)
    model = build_model(tiny_config(architecture))
    try:
        parallelizer.parallelize(model, context)
    except (ValueError, RuntimeError) as error:
        untouched = not any(isinstance(p, DTensor) for p in model.parameters())
        return f"{type(error).__name__}: {error} (untouched={untouched})"
    return "no error"


def parallelize_log(layout: dict[str, Any], architecture: str = "llama") -> list[str]:
    """The lines ``parallelize`` logs at INFO (rank 0 logs; the others return none)."""
    import logging

    from tests.tiny_models import tiny_config

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("automodel.distributed")
    handler, level = Collect(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ModelParallelizer().parallelize(build_model(tiny_config(architecture)), MeshContext.build(**layout))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return records


def without_declared_blocks(layout: dict[str, Any]) -> dict[str, Any]:
    """A causal LM whose class declares no `_no_split_modules`: its repeated blocks become the FSDP units and AC
    blocks; parity with the same model in one process."""
    context = MeshContext.build(**layout)
    reference = build_model(tiny_llama_config())
    model = copy.deepcopy(reference)
    model._no_split_modules = []
    model = ModelParallelizer().parallelize(model, context)
    units = sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))
    checkpointed = sorted(n for n, m in model.named_modules() if getattr(m, "_automodel_checkpointed", False))
    return {
        "units": units,
        "checkpointed": checkpointed,
        **compare_with_reference(reference, model, context, token_batch()),
    }
