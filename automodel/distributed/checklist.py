"""The one parallelization flow. Every path runs the same steps, in the same order:

    TP (expert rules dropped under EP) -> EP -> CP -> activation checkpointing -> compile -> trainability -> shard

where the shard step is FSDP2 units (the experts first, over ``ep_shard``, under EP; then the dense units), DDP, or
Megatron-FSDP. Each step is a plain function of the resolved inputs and returns one line saying what it did (or
``None`` when it had nothing to do); ``ModelParallelizer._apply`` runs them in order and rank 0 logs the lines. The
sidecar hooks are called from here and nowhere else, so a sidecar's policy holds on every path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from automodel._compat.torch import fsdp_state

from .activation_checkpointing import apply_activation_checkpointing
from .compile import CompileDecision, compile_blocks, decide_compile
from .config import DDPConfig, FSDP2Config, MegatronFSDPConfig
from .context_parallel import apply_context_parallel
from .ddp import apply_ddp
from .derived_tp_plan import DERIVED_SOURCE
from .expert_parallel import apply_expert_parallel, drop_expert_rules, shard_experts, validate_experts
from .fsdp import (
    fully_shard_default,
    prefetch_decoder_layers,
    reshard_after_gradless_forward,
    shard_default_units,
    unshard_for_outside_calls,
)
from .hook_policy import overrides
from .megatron_fsdp import apply_megatron_fsdp
from .mesh import MeshContext
from .model_structure import decoder_layers, encoder_tower_blocks, input_embeddings, output_embeddings
from .tensor_parallel import TPPlanChoice, apply_tensor_parallel, check_plan_rules, choose_tp_plan

if TYPE_CHECKING:
    from .parallelizer import ModelParallelizer

__all__ = [
    "activation_checkpointing_step",
    "compile_step",
    "validate_compile",
    "context_parallel_step",
    "expert_parallel_step",
    "plan_tensor_parallel",
    "shard_step",
    "tensor_parallel_step",
    "trainability_step",
    "validate_encoder_towers",
    "validate_expert_parallel",
]

logger = logging.getLogger(__name__)

ExpertGroups = list[list[nn.Module]]


def validate_expert_parallel(model: nn.Module, context: MeshContext) -> list[str]:
    """The names of the routed-experts modules EP will own (empty without EP); raises before anything is touched
    when the model cannot be split over ``ep_size``."""
    if context.ep_size == 1:
        return []
    return validate_experts(model, context.ep_size, context.tp_size)


def validate_encoder_towers(model: nn.Module, cp_size: int) -> None:
    """Refuse context parallelism for a model with an encoder tower beside its language decoder (a vision-language
    model), before anything is touched; say why. Its other steps need nothing special: the tower's blocks are FSDP /
    activation-checkpointing units like the decoder layers, TP leaves the blocks its plan does not name replicated
    over ``tp`` (each rank computes their whole gradient), and SP applies to the language decoder's layers."""
    if cp_size == 1:
        return
    blocks = encoder_tower_blocks(model)
    if not blocks:
        return
    raise ValueError(
        f"{type(model).__name__} has an encoder tower beside its language decoder ({len(blocks)} blocks of "
        f"{sorted({type(block).__name__ for block in blocks})}): context parallelism (cp_size={cp_size}) splits the "
        "token sequence over the cp ranks before the model runs, but the encoder's features (image embeddings) are "
        "merged into the sequence at the positions of their placeholder tokens, and multimodal position ids are "
        "computed from the whole sequence, so a rank would get features for placeholders it does not hold. Use "
        "cp_size=1 for this model."
    )


def plan_tensor_parallel(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    tp_mesh: DeviceMesh,
    tp_shard_plan: Any,
    expert_names: list[str],
) -> TPPlanChoice | None:
    """Choose and validate the TP plan (``None`` without TP), before anything is sharded.

    Precedence: the user's plan > ``tp_shard_plan`` (the sidecar's, as ``_apply`` received it) > the model's own.
    Under EP the rules for the routed experts are dropped (EP owns them). The model records the plan it is sharded
    with (as transformers' own TP does), so ``_validate_tp_mesh`` and later readers see the plan actually applied.
    """
    if tp_mesh.size() == 1:
        return None
    choice = choose_tp_plan(model, tp_shard_plan, tp_mesh.size(), sidecar=type(parallelizer).__name__)
    check_plan_rules(model, choice)
    if expert_names:
        choice = TPPlanChoice(drop_expert_rules(choice.plan, expert_names), choice.source)
    model._tp_plan = choice.plan
    parallelizer._validate_tp_mesh(model, tp_mesh)
    return choice


def tensor_parallel_step(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    choice: TPPlanChoice | None,
    sequence_parallel: bool,
    expert_names: list[str],
) -> str | None:
    """Shard the plan's parameters over ``tp`` and install its forward transforms (+ sequence parallelism); the routed
    experts are left to EP."""
    if choice is None:
        return None
    apply_tensor_parallel(
        model,
        tp_mesh,
        choice.plan,
        sequence_parallel=sequence_parallel,
        owned_elsewhere=expert_names,
        check_gradients=choice.source == DERIVED_SOURCE,
    )
    sp = ", sequence parallel" if sequence_parallel else ""
    source = choice.source if choice.source == DERIVED_SOURCE else f"from {choice.source}"
    return f"TP over tp={tp_mesh.size()} (plan: {len(choice.plan)} rules {source}{sp})"


def expert_parallel_step(model: nn.Module, context: MeshContext, expert_names: list[str]) -> ExpertGroups:
    """Split the routed experts over ``ep`` and route their tokens to their owners; return the experts modules,
    grouped with the twins that share them."""
    if not expert_names:
        return []
    return apply_expert_parallel(model, context.mesh("ep"), context.mesh("tp"))


def context_parallel_step(model: nn.Module, cp_mesh: DeviceMesh) -> str | None:
    """Switch attention to the context-parallel kernel over ``cp``."""
    if cp_mesh.size() == 1:
        return None
    apply_context_parallel(model, cp_mesh)
    return f"CP over cp={cp_mesh.size()} on {len(decoder_layers(model))} blocks"


def activation_checkpointing_step(
    parallelizer: ModelParallelizer, model: nn.Module, mode: bool | str, replay_routing: bool
) -> str | None:
    """Checkpoint each block's attention / MLP (or whole blocks, when the sidecar's
    ``_use_full_layer_activation_checkpointing`` says so)."""
    if not mode:
        return None
    mode = "full" if mode is True else mode
    full_layers = parallelizer._use_full_layer_activation_checkpointing(model)
    targets = apply_activation_checkpointing(model, mode, full_layers=full_layers, replay_routing=replay_routing)
    unit = "whole blocks" if full_layers else f"modules of {len(decoder_layers(model))} blocks"
    return f"AC {mode} on {len(targets)} {unit}"


def validate_compile(context: MeshContext) -> CompileDecision:
    """Resolve ``context.compile`` before anything is touched; raises where an explicit ``compile=True`` cannot apply
    (EP, Megatron-FSDP, no C++ compiler for inductor on CPU)."""
    return decide_compile(context)


def compile_step(model: nn.Module, decision: CompileDecision) -> str:
    """``torch.compile`` each decoder block's forward (with the TP transforms and checkpoint wrappers inside it),
    before sharding, so FSDP2's hooks stay around the compiled forward."""
    if not decision.enabled:
        return f"compile: off ({decision.why})"
    return f"compile: on ({decision.why}), {compile_blocks(model)} blocks (compiled at the first forward)"


def trainability_step(
    model: nn.Module, requires_grad: dict[str, bool], reapply: Callable[[nn.Module], None] | None
) -> str | None:
    """Give every parameter back the ``requires_grad`` it had before parallelization (TP and EP build new
    ``Parameter`` objects, and some styles make them trainable), then run the context's ``reapply_trainability``.

    Runs after every step that could reset it and before sharding, so FSDP sees the final trainability.
    """
    for name, param in model.named_parameters():
        if name in requires_grad:
            param.requires_grad_(requires_grad[name])
    if reapply is not None:
        reapply(model)
    params = list(model.parameters())
    trainable = [param for param in params if param.requires_grad]
    if reapply is None and len(trainable) == len(params):
        return None
    source = "reapply_trainability" if reapply is not None else "as before parallelization"
    elements = sum(param.numel() for param in trainable)
    total = sum(param.numel() for param in params)
    return (
        f"trainability ({source}): {elements:,} of {total:,} parameters trainable "
        f"({len(trainable)} of {len(params)} tensors)"
    )


def shard_step(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    context: MeshContext,
    experts: ExpertGroups,
    fsdp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool | None,
) -> tuple[nn.Module, str | None]:
    """The strategy's wrapping: FSDP2 units, DDP, or Megatron-FSDP. Returns the model (Megatron-FSDP's wrapper) and
    the line to log."""
    strategy = context.strategy
    if isinstance(strategy, DDPConfig):
        return apply_ddp(model, context), f"DDP over dp={context.dp_size}"
    if isinstance(strategy, MegatronFSDPConfig):
        return apply_megatron_fsdp(model, context), f"Megatron-FSDP over dp_shard_cp={context.size('dp_shard_cp')}"
    assert isinstance(strategy, FSDP2Config), f"unknown strategy {type(strategy).__name__}"
    options = {"mp_policy": mp_policy, "offload_policy": offload_policy}
    use_sidecar_primitive = not experts or parallelizer._customizes_moe_fsdp
    primitive = parallelizer._fully_shard_module if use_sidecar_primitive else fully_shard_default
    if experts:
        shard_experts(
            experts,
            primitive,
            mesh=context.mesh("ep_shard"),
            batches_per_step=context.world_size // context.tp_size,
            reshard_after_forward=reshard_after_forward,
            **options,
        )
    if fsdp_mesh.size() > 1:
        if use_sidecar_primitive or not overrides(parallelizer, "_fully_shard_module"):
            parallelizer._apply_fsdp_sharding(
                model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, **options
            )
        else:
            # `_customizes_moe_fsdp = False`: the sidecar's primitive is not used after EP took the experts (the
            # hook check has refused a sidecar that also chooses its own units).
            shard_default_units(
                model, fully_shard_default, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, **options
            )
    unshard_for_outside_calls(model)
    reshard_after_gradless_forward(model)
    if strategy.prefetch:
        prefetch_decoder_layers(model)
    return model, _describe_fsdp_units(model, experts, context, fsdp_mesh)


def _describe_fsdp_units(model: nn.Module, experts: ExpertGroups, context: MeshContext, mesh: DeviceMesh) -> str | None:
    """``"FSDP2 units: 4 experts over ep_shard=2; 24 layers + embeddings + head + root over dp_shard_cp=4"``; a
    vision-language model's vision blocks are counted as ``encoder blocks``."""
    units: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(fsdp_state(module)), module)
    if not units:
        return None
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
    parts = [f"{count} {kind}" if count > 1 or kind == "layers" else kind for kind, count in counts.items() if count]
    over = ", ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    line = " + ".join([*parts, "root"]) + f" over {over}"
    if experts:
        line = f"{len(experts)} experts over ep_shard={context.size('ep_shard')}; {line}"
    policy = {None: "all but the last layer and the head", True: "always", False: "never"}
    line += f"; reshard after forward: {policy[context.strategy.reshard_after_forward]}"
    return f"FSDP2 units: {line}" + ("; layers prefetch" if context.strategy.prefetch else "")
