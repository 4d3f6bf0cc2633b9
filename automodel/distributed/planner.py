"""The planner: every decision and every refusal of ``parallelize``, made on the model as it is, before anything is
touched (:func:`plan_parallelization` -> :class:`~automodel.distributed.plan.ParallelPlan`).

It reads the model's structure once and the options ``_apply`` receives (derived from the one ``MeshContext``:
:func:`apply_arguments`), and raises, naming the thing and the fix, wherever the run would be refused: the sidecar's
hooks against the path, the strategy, encoder towers under CP, the experts under EP, compile, the TP plan (its rules,
the heads against ``tp``, the sidecar's ``_validate_tp_mesh``, adapters, sequence parallelism, Conv1D forms, tied
placements), CP's blocks and the AC mode. It never mutates the model: ``_validate_tp_mesh`` sees ``model._tp_plan``
set to the plan being checked, and the attribute is put back as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .activation_checkpointing import checkpoint_targets
from .compile import decide_compile
from .config import DDPConfig, FSDP2Config, MegatronFSDPConfig
from .context_parallel import check_context_parallel
from .derived_tp_plan import DERIVED_SOURCE
from .expert_parallel import drop_expert_rules, validate_experts
from .fsdp import default_fsdp_units, fsdp_mesh
from .megatron_fsdp import require_megatron_fsdp
from .model_structure import (
    decoder_layers,
    encoder_tower_blocks,
    input_embeddings,
    output_embeddings,
    tied_module_groups,
)
from .plan import (
    CheckpointingPlan,
    CompilePlan,
    ContextParallelPlan,
    ExpertParallelPlan,
    ParallelPlan,
    ShardingPlan,
    TensorParallelPlan,
    TrainabilityPlan,
)
from .sequence_parallel import sequence_parallel_layout
from .tensor_parallel import check_plan_rules, check_tied_placements, choose_tp_plan, expanded_rules, planned_styles

if TYPE_CHECKING:
    from .mesh import MeshContext
    from .parallelizer import ModelParallelizer

__all__ = [
    "FSDP_HOOKS",
    "Planned",
    "apply_arguments",
    "check_hooks",
    "check_parallelization",
    "check_parallelizer",
    "overrides",
    "path_name",
    "plan_parallelization",
    "plan_with",
]

#: The hooks that decide FSDP2 units and how each is sharded.
FSDP_HOOKS = ("_apply_fsdp_sharding", "_fully_shard_module")


@dataclass(frozen=True)
class Planned:
    """A plan and the ``_apply`` options it was made from (``parallelize`` hands both to ``_apply``, which re-plans
    only if a sidecar's override changed an option on the way)."""

    plan: ParallelPlan
    options: dict[str, Any]

    def made_from(self, options: dict[str, Any]) -> bool:
        """Whether ``options`` are the ones the plan was made from (the same objects, or equal values)."""
        return self.options.keys() == options.keys() and all(
            value is options[key] or _equal(value, options[key]) for key, value in self.options.items()
        )


def plan_parallelization(parallelizer: ModelParallelizer, model: nn.Module, mesh_context: MeshContext) -> ParallelPlan:
    """The frozen plan of ``parallelizer`` for ``model`` on ``mesh_context``; raises every refusal the run would, on
    every rank alike, and touches nothing. (A sidecar that overrides ``_apply`` may change the options before it
    calls ``super()._apply``, which plans again with them.)"""
    return plan_with(parallelizer, model, mesh_context, apply_arguments(parallelizer, mesh_context))


def check_parallelization(parallelizer: ModelParallelizer, model: nn.Module, mesh_context: MeshContext) -> None:
    """Raise what ``parallelize`` would refuse, as cheaply as it can be known: the planner alone (nothing touched)
    where the parallelizer keeps the shared ``_apply``; the real ``parallelize`` where a sidecar overrides it (its
    refusals and its own set-up live there: pass a model on meta)."""
    if overrides(parallelizer, "_apply"):
        parallelizer.parallelize(model, mesh_context)
    else:
        plan_parallelization(parallelizer, model, mesh_context)


def apply_arguments(parallelizer: ModelParallelizer, context: MeshContext) -> dict[str, Any]:
    """The documented ``_apply`` keyword arguments, derived from the one ``MeshContext``; the context itself and the
    router policy travel in ``**kwargs``."""
    strategy = context.strategy
    fsdp2 = isinstance(strategy, FSDP2Config)
    return {
        "device_mesh": context.device_mesh,
        "mp_policy": strategy.mp_policy() if fsdp2 else None,
        "offload_policy": strategy.offload_policy() if fsdp2 else None,
        "sequence_parallel": context.sequence_parallel,
        "activation_checkpointing": context.activation_checkpointing,
        "tp_shard_plan": parallelizer._tp_plan,
        "reshard_after_forward": strategy.reshard_after_forward if fsdp2 else None,
        "reapply_trainability": context.reapply_trainability,
        "mesh_context": context,
        "save_router_decisions": context.moe.save_router_decisions,
    }


def plan_with(
    parallelizer: ModelParallelizer, model: nn.Module, context: MeshContext, options: dict[str, Any]
) -> ParallelPlan:
    """The plan for the ``_apply`` keyword arguments ``options`` (the named ones and the ``kwargs``)."""
    notes = check_parallelizer(parallelizer, context)
    device_mesh = options["device_mesh"]
    tp_mesh = device_mesh[options.get("tp_mesh_name", "tp")]
    cp_size = device_mesh["cp"].size()
    structure = _Structure(model)
    _check_encoder_towers(model, cp_size)
    experts = validate_experts(model, context.ep_size, context.tp_size) if context.ep_size > 1 else []
    compiling = decide_compile(context)
    tp = _plan_tensor_parallel(parallelizer, model, tp_mesh, options, experts)
    ep = ExpertParallelPlan(context.ep_size, tuple(experts)) if experts else None
    cp = None
    if cp_size > 1:
        check_context_parallel(model)
        cp = ContextParallelPlan(cp_size, len(structure.layers()))
    ac = _plan_checkpointing(parallelizer, model, structure, options)
    compile_plan = CompilePlan(compiling.enabled, compiling.why, len(structure.layers()) if compiling.enabled else 0)
    sharding = _plan_sharding(parallelizer, model, context, options, experts, structure)
    return ParallelPlan(
        model=type(model).__name__,
        parallelizer=type(parallelizer).__name__,
        path=path_name(context),
        decoder_blocks=structure.layer_names(),
        tp=tp,
        ep=ep,
        cp=cp,
        ac=ac,
        compile=compile_plan,
        trainability=_plan_trainability(model, options.get("reapply_trainability")),
        sharding=sharding,
        notes=tuple(notes),
    )


class _Structure:
    """The model's structure, read once and only where a step needs it (a DDP model need not have decoder
    blocks)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._layers: list[nn.Module] | None = None
        self._names: dict[int, str] | None = None

    def layers(self) -> list[nn.Module]:
        if self._layers is None:
            self._layers = decoder_layers(self.model)
        return self._layers

    def names(self) -> dict[int, str]:
        if self._names is None:
            self._names = {id(module): name for name, module in self.model.named_modules()}
        return self._names

    def layer_names(self) -> tuple[str, ...]:
        if self._layers is None:
            return ()
        return tuple(self.names()[id(layer)] for layer in self._layers)


# -- hooks and strategy ---------------------------------------------------------------------------------------------


def overrides(parallelizer: ModelParallelizer, hook: str) -> bool:
    """Whether ``parallelizer``'s class (or the instance itself) replaces the shared ``hook``: a class below the one
    that first defines it (``ModelParallelizer``) in the method resolution order defines it again."""
    if hook in vars(parallelizer):
        return True
    return sum(hook in vars(cls) for cls in type(parallelizer).__mro__) > 1


def path_name(context: MeshContext) -> str:
    """The dispatch path ``context`` selects, as the errors and logs name it."""
    strategy = context.strategy
    if context.ep_size > 1:
        return f"the unified MoE path (ep_size={context.ep_size})"
    if isinstance(strategy, FSDP2Config):
        return "the dense FSDP2 path"
    if isinstance(strategy, DDPConfig):
        return "the DDP path"
    return "the Megatron-FSDP path"


def check_parallelizer(parallelizer: ModelParallelizer, context: MeshContext) -> list[str]:
    """The checks of the parallelizer against the path, before anything of the model is read: its hooks
    (:func:`check_hooks`, whose notes it returns) and the strategy."""
    notes = check_hooks(parallelizer, context)
    _check_strategy(context)
    return notes


def check_hooks(parallelizer: ModelParallelizer, context: MeshContext) -> list[str]:
    """Raise when the path ``context`` selects cannot apply one of ``parallelizer``'s overridden hooks; return what to
    say where a hook has nothing to act on (never skipped silently)."""
    sidecar = type(parallelizer).__name__
    path = path_name(context)
    overridden = [hook for hook in FSDP_HOOKS if overrides(parallelizer, hook)]
    if not overridden:
        return []
    strategy = context.strategy
    if isinstance(strategy, MegatronFSDPConfig):
        raise ValueError(
            f"{sidecar} overrides {_listing(overridden)} (how the model is cut into FSDP2 units and sharded); {path} "
            "shards by unit classes with its own primitive and cannot apply that. Use strategy='fsdp2' for this model."
        )
    if isinstance(strategy, DDPConfig):
        return [
            f"{path}: {_listing(overridden)} of {sidecar} do not apply (DDP keeps the whole model on every rank: there "
            "are no FSDP units)."
        ]
    if context.ep_size == 1 or parallelizer._customizes_moe_fsdp or "_fully_shard_module" not in overridden:
        return []
    if "_apply_fsdp_sharding" in overridden:
        raise ValueError(
            f"{sidecar} overrides `_apply_fsdp_sharding` and `_fully_shard_module` but keeps "
            f"`_customizes_moe_fsdp = False`, so on {path} its units would have to be sharded without its primitive. "
            "Set `_customizes_moe_fsdp = True` if the primitive is safe once EP owns the experts (experts modules "
            "arrive already sharded over ep_shard), or use ep_size=1."
        )
    return [
        f"{path}: {sidecar} keeps `_customizes_moe_fsdp = False`, so its `_fully_shard_module` is not used there; the "
        "units are sharded with the shared fully_shard."
    ]


def _listing(hooks: list[str]) -> str:
    return " and ".join(f"`{hook}`" for hook in hooks)


def _check_strategy(context: MeshContext) -> None:
    """Refuse what no path can run (``MeshContext.build`` refuses these too; a context built field by field reaches
    here)."""
    strategy = context.strategy
    if context.ep_size > 1 and not isinstance(strategy, FSDP2Config):
        raise ValueError(
            f"ep_size={context.ep_size} runs on the unified MoE path, which shards with FSDP2: use strategy='fsdp2' "
            f"(got {strategy.name!r})."
        )
    if isinstance(strategy, MegatronFSDPConfig):
        require_megatron_fsdp()
        if context.cp_size > 1:
            raise ValueError(
                f"strategy='megatron_fsdp' with cp_size={context.cp_size} is not supported: use strategy='fsdp2' "
                "for context parallelism."
            )


def _check_encoder_towers(model: nn.Module, cp_size: int) -> None:
    """Refuse context parallelism for a model with an encoder tower beside its language decoder (a vision-language
    model): say why. Its other steps need nothing special: the tower's blocks are FSDP / activation-checkpointing
    units like the decoder layers, TP leaves the blocks its plan does not name replicated over ``tp`` (each rank
    computes their whole gradient), and SP applies to the language decoder's layers."""
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


# -- the steps ------------------------------------------------------------------------------------------------------


def _plan_tensor_parallel(
    parallelizer: ModelParallelizer, model: nn.Module, tp_mesh: Any, options: dict[str, Any], experts: list[str]
) -> TensorParallelPlan | None:
    """Choose and check the TP plan (``None`` without TP). Precedence: the user's plan > ``tp_shard_plan`` (the
    sidecar's, as ``_apply`` received it) > the model's own > derived. Under EP the routed experts' rules are
    dropped (EP owns them)."""
    if tp_mesh.size() == 1:
        return None
    choice = choose_tp_plan(model, options.get("tp_shard_plan"), tp_mesh.size(), sidecar=type(parallelizer).__name__)
    check_plan_rules(model, choice)
    rules = drop_expert_rules(choice.plan, experts) if experts else choice.plan
    _validate_tp_mesh(parallelizer, model, tp_mesh, rules)
    sequence_parallel = bool(options.get("sequence_parallel"))
    expanded = expanded_rules(model, rules, sequence_parallel)
    sp_layout = sequence_parallel_layout(model, expanded) if sequence_parallel else None
    styles = planned_styles(model, expanded, sp_layout)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, style in styles.items():
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            style.validate_param(modules[module_name], param_name, tp_mesh, parameter_name=name)
    check_tied_placements(model, styles, tp_mesh)
    adapters = {name: style for name, style in expanded.items() if ".lora_" in name}
    return TensorParallelPlan(
        size=tp_mesh.size(),
        rules=dict(rules),
        source=choice.source,
        derived=choice.source == DERIVED_SOURCE,
        sequence_parallel=sequence_parallel,
        adapter_rules=adapters,
    )


def _validate_tp_mesh(parallelizer: ModelParallelizer, model: nn.Module, tp_mesh: Any, rules: dict[str, str]) -> None:
    """The sidecar hook, with ``model._tp_plan`` holding the plan being checked (as transformers' own TP records it),
    put back as it was afterwards."""
    missing = object()
    before = model.__dict__.get("_tp_plan", missing)
    model._tp_plan = rules
    try:
        parallelizer._validate_tp_mesh(model, tp_mesh)
    finally:
        if before is missing:
            del model._tp_plan
        else:
            model._tp_plan = before


def _plan_checkpointing(
    parallelizer: ModelParallelizer, model: nn.Module, structure: _Structure, options: dict[str, Any]
) -> CheckpointingPlan | None:
    mode = options.get("activation_checkpointing")
    if not mode:
        return None
    mode = "full" if mode is True else mode
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} is not 'full' or 'selective'.")
    full_layers = parallelizer._use_full_layer_activation_checkpointing(model)
    layers = structure.layers()
    names = structure.names()
    targets = tuple(names[id(module)] for module in checkpoint_targets(layers, full_layers=full_layers))
    replay = options.get("save_router_decisions", options["mesh_context"].moe.save_router_decisions)
    return CheckpointingPlan(mode, targets, full_layers, len(layers), bool(replay))


def _plan_trainability(model: nn.Module, reapply: Callable[[nn.Module], None] | None) -> TrainabilityPlan:
    params = list(model.parameters())
    trainable = [param for param in params if param.requires_grad]
    return TrainabilityPlan(
        frozen=tuple(name for name, param in model.named_parameters() if not param.requires_grad),
        trainable_elements=sum(param.numel() for param in trainable),
        total_elements=sum(param.numel() for param in params),
        trainable_tensors=len(trainable),
        total_tensors=len(params),
        reapply=reapply is not None,
    )


def _plan_sharding(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    context: MeshContext,
    options: dict[str, Any],
    experts: list[str],
    structure: _Structure,
) -> ShardingPlan:
    strategy = context.strategy
    if isinstance(strategy, DDPConfig):
        return ShardingPlan("ddp", {"dp": context.dp_size})
    if isinstance(strategy, MegatronFSDPConfig):
        return ShardingPlan("megatron_fsdp", {"dp_shard_cp": context.size("dp_shard_cp")})
    mesh = fsdp_mesh(
        options["device_mesh"],
        options.get("dp_replicate_mesh_name", "dp_replicate"),
        options.get("dp_shard_cp_mesh_name", "dp_shard_cp"),
    )
    sidecar = type(parallelizer).__name__
    sidecar_primitive = not experts or parallelizer._customizes_moe_fsdp
    units: dict[str, int] | None = {}
    source = "the shared default units"
    if mesh.size() > 1:
        chooses_units = sidecar_primitive or not overrides(parallelizer, "_fully_shard_module")
        if chooses_units and overrides(parallelizer, "_apply_fsdp_sharding"):
            units, source = None, f"{sidecar}._apply_fsdp_sharding"
        elif sidecar_primitive and overrides(parallelizer, "_fully_shard_module"):
            units, source = None, f"the shared default units, sharded by {sidecar}._fully_shard_module"
        else:
            units = _default_unit_kinds(model, structure, experts)
    expert_modules = [model.get_submodule(name) for name in experts]
    primitive = f"{sidecar}._fully_shard_module" if overrides(parallelizer, "_fully_shard_module") else "fully_shard"
    return ShardingPlan(
        kind="fsdp2",
        mesh=dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        units=units,
        units_source=source,
        experts_over=context.size("ep_shard") if experts else None,
        expert_units=len(tied_module_groups(expert_modules)) if experts else 0,
        reshard_after_forward=options.get("reshard_after_forward"),
        prefetch=bool(getattr(strategy, "prefetch", False)),
        primitive=primitive if sidecar_primitive else "fully_shard",
    )


def _default_unit_kinds(model: nn.Module, structure: _Structure, experts: list[str]) -> dict[str, int]:
    """The kinds of the default FSDP2 units (``fsdp.default_fsdp_units``), counted in module order: decoder
    ``layers``, ``encoder blocks``, ``embeddings``, ``head``, or the module's class."""
    units = {id(module) for module, _ in default_fsdp_units(model)}
    expert_ids = {id(model.get_submodule(name)) for name in experts}
    layers = {id(layer) for layer in structure.layers()}
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    named = {id(input_embeddings(model)): "embeddings", id(output_embeddings(model)): "head"}
    counts: dict[str, int] = {"layers": 0}
    for module in model.modules():
        if id(module) not in units or id(module) in expert_ids or module is model:
            continue
        if id(module) in encoder:
            kind = "encoder blocks"
        elif id(module) in layers:
            kind = "layers"
        else:
            kind = named.get(id(module), type(module).__name__)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _equal(left: Any, right: Any) -> bool:
    try:
        return bool(left == right)
    except Exception:  # noqa: BLE001 - objects whose comparison fails are not the same option
        return False
