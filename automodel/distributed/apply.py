"""``apply_plan``: carry out a :class:`~automodel.distributed.plan.ParallelPlan`, straight through

    TP (expert rules dropped under EP) -> EP -> CP -> activation checkpointing -> compile -> trainability -> shard

where the shard step is FSDP2 units (the experts first, over ``ep_shard``, under EP; then the dense units), DDP, or
Megatron-FSDP. Every decision was made by the planner (:mod:`.planner`), which refused what cannot run before the
model was touched; nothing here decides. The sidecar hooks that shape the result (``_apply_fsdp_sharding``,
``_fully_shard_module``) are called from here and nowhere else, so a sidecar's policy holds on every path.

The module wrappers compose in this one order, each wrapping what the step before installed: TP's styles wrap the
projections' forwards (and hand back owned outputs around the model's), activation checkpointing wraps the blocks'
attention / MLP (or whole blocks), compile wraps each block's forward (with TP and the checkpoint wrappers traced
inside it), and FSDP2's unshard / reshard hooks sit around the blocks, outside the compiled graph.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from automodel._compat.torch import fsdp_state, shard_chunks_on_demand, shared_mesh_concatenations

from .activation_checkpointing import checkpoint_module
from .compile import compile_blocks
from .context_parallel import apply_context_parallel
from .ddp import apply_ddp
from .expert_parallel import apply_expert_parallel, shard_experts
from .fsdp import (
    fsdp_mesh,
    fully_shard_default,
    prefetch_decoder_layers,
    reshard_after_gradless_forward,
    route_encoders_through_root,
    shard_default_units,
    unshard_for_outside_calls,
)
from .megatron_fsdp import apply_megatron_fsdp
from .model_structure import decoder_layers, encoder_tower_blocks, input_embeddings, output_embeddings
from .plan import ParallelPlan
from .planner import overrides
from .runtime import log_rank_zero
from .tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from .mesh import MeshContext
    from .parallelizer import ModelParallelizer

__all__ = ["apply_plan"]

logger = logging.getLogger(__name__)

ExpertGroups = list[list[nn.Module]]


def apply_plan(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    plan: ParallelPlan,
    context: MeshContext,
    options: dict[str, Any],
) -> nn.Module:
    """Parallelize ``model`` as ``plan`` says (``options``: the ``_apply`` keyword arguments it was made from), log
    its steps on rank 0, and return the model (Megatron-FSDP's wrapper on that path). The model records the plan
    (``parallel_plan``) and, under TP, the TP plan it is sharded with (``_tp_plan``, as transformers' own TP does)."""
    device_mesh = options["device_mesh"]
    requires_grad = {name: param.requires_grad for name, param in model.named_parameters()}
    experts: ExpertGroups = []
    if plan.tp is not None:
        model._tp_plan = plan.tp.rules
        apply_tensor_parallel(
            model,
            device_mesh[options.get("tp_mesh_name", "tp")],
            plan.tp.rules,
            sequence_parallel=plan.tp.sequence_parallel,
            owned_elsewhere=list(plan.ep.experts) if plan.ep else [],
            check_gradients=plan.tp.derived,
        )
    if plan.ep is not None:
        experts = apply_expert_parallel(model, context.mesh("ep"), context.mesh("tp"))
    if plan.cp is not None:
        apply_context_parallel(model, device_mesh["cp"])
    if plan.ac is not None:
        for name in plan.ac.targets:
            checkpoint_module(
                model.get_submodule(name), selective=plan.ac.mode == "selective", replay_routing=plan.ac.replay_routing
            )
    if plan.compile.enabled:
        compile_blocks(model)
    trainability = _restore_trainability(model, requires_grad, options.get("reapply_trainability"), plan)
    model, sharded = _shard(parallelizer, model, plan, context, options, experts)
    for line in plan.steps(trainability=trainability, sharding=sharded):
        log_rank_zero(logger, "%s", line)
    model.parallel_plan = plan
    return model


def _restore_trainability(
    model: nn.Module, requires_grad: dict[str, bool], reapply: Any, plan: ParallelPlan
) -> str | None:
    """Give every parameter back the ``requires_grad`` it had before parallelization (TP and EP build new
    ``Parameter`` objects, and some styles make them trainable), then run the context's ``reapply_trainability``;
    the line to log after the callback, counted again (its effect the plan cannot know); ``None`` without one.

    Runs after every step that could reset it and before sharding, so FSDP sees the final trainability.
    """
    for name, param in model.named_parameters():
        if name in requires_grad:
            param.requires_grad_(requires_grad[name])
    if reapply is None:
        return None  # the plan's line
    reapply(model)
    params = list(model.parameters())
    trainable = [param for param in params if param.requires_grad]
    elements = sum(param.numel() for param in trainable)
    total = sum(param.numel() for param in params)
    return (
        f"trainability (reapply_trainability): {elements:,} of {total:,} parameters trainable "
        f"({len(trainable)} of {len(params)} tensors)"
    )


def _shard(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    plan: ParallelPlan,
    context: MeshContext,
    options: dict[str, Any],
    experts: ExpertGroups,
) -> tuple[nn.Module, str | None]:
    """The strategy's wrapping: FSDP2 units, DDP, or Megatron-FSDP. Returns the model (Megatron-FSDP's wrapper) and,
    for units a sidecar's hook shaped, the FSDP2 line counted on the sharded model (else ``None``: the plan's)."""
    kind = plan.sharding.kind
    if kind == "ddp":
        return apply_ddp(model, context), None
    if kind == "megatron_fsdp":
        return apply_megatron_fsdp(model, context), None
    assert kind == "fsdp2", f"unknown sharding {kind!r}"
    # torch's fully_shard made cheaper at scale: one (DP, TP) mesh for all TP / EP parameters, not one each, and only
    # the chunks of a parameter it uses, not one per rank (see the two shims).
    with shared_mesh_concatenations(), shard_chunks_on_demand():
        _fully_shard_units(parallelizer, model, context, options, experts)
    unshard_for_outside_calls(model)
    route_encoders_through_root(model)
    reshard_after_gradless_forward(model)
    if plan.sharding.prefetch:
        prefetch_decoder_layers(model)
    if plan.sharding.units is not None:
        return model, None  # the plan's line
    return model, plan.sharding.fsdp_line(_sharded_unit_kinds(model, experts))


def _fully_shard_units(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    context: MeshContext,
    options: dict[str, Any],
    experts: ExpertGroups,
) -> None:
    """FSDP2's units: the experts over ``ep_shard`` under EP (with the sidecar's primitive unless it opted out), then
    the dense units through the sidecar's ``_apply_fsdp_sharding`` (skipped on an FSDP mesh of one rank)."""
    reshard_after_forward = options.get("reshard_after_forward")
    shard_options = {"mp_policy": options.get("mp_policy"), "offload_policy": options.get("offload_policy")}
    use_sidecar_primitive = not experts or parallelizer._customizes_moe_fsdp
    primitive = parallelizer._fully_shard_module if use_sidecar_primitive else fully_shard_default
    if experts:
        shard_experts(
            experts,
            primitive,
            mesh=context.mesh("ep_shard"),
            batches_per_step=context.world_size // context.tp_size,
            reshard_after_forward=reshard_after_forward,
            **shard_options,
        )
    mesh = fsdp_mesh(
        options["device_mesh"],
        options.get("dp_replicate_mesh_name", "dp_replicate"),
        options.get("dp_shard_cp_mesh_name", "dp_shard_cp"),
    )
    if mesh.size() > 1:
        if use_sidecar_primitive or not overrides(parallelizer, "_fully_shard_module"):
            parallelizer._apply_fsdp_sharding(
                model, mesh=mesh, reshard_after_forward=reshard_after_forward, **shard_options
            )
        else:
            # `_customizes_moe_fsdp = False`: the sidecar's primitive is not used after EP took the experts (the
            # planner has refused a sidecar that also chooses its own units).
            shard_default_units(
                model, fully_shard_default, mesh=mesh, reshard_after_forward=reshard_after_forward, **shard_options
            )


def _sharded_unit_kinds(model: nn.Module, experts: ExpertGroups) -> dict[str, int]:
    """The FSDP2 units of the sharded model by kind (one per FSDP state), in module order: what a sidecar's hooks
    made of them."""
    units: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(fsdp_state(module)), module)
    expert_modules = {id(module) for group in experts for module in group}
    layers = {id(layer) for layer in decoder_layers(model)}
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    named = {id(input_embeddings(model)): "embeddings", id(output_embeddings(model)): "head"}
    counts: dict[str, int] = {"layers": 0}
    for first in units.values():
        if id(first) in expert_modules or first is model:
            continue
        if id(first) in encoder:
            kind = "encoder blocks"
        elif id(first) in layers:
            kind = "layers"
        else:
            kind = named.get(id(first), type(first).__name__.removeprefix("FSDP"))
        counts[kind] = counts.get(kind, 0) + 1
    return counts if units else {}
