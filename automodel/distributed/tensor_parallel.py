"""Tensor parallelism (+ sequence parallelism) from a TP plan.

Plans are transformers' plans: literal dicts from module / parameter names (with ``*`` for layer numbers) to
transformers' style names. One plan applies, chosen by a stated precedence (:func:`choose_tp_plan`): the one a user
passes to ``from_pretrained(tp_plan=...)``, else the sidecar's, else the model's own, else one derived from the module
tree (:mod:`derived_tp_plan`). Shared code never writes a per-architecture plan; a model from which none can be
derived gets a clear error saying why.
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from .adapters import adapter_placements
from .derived_tp_plan import DERIVED_SOURCE, derive_tp_plan
from .hf_plans import expand_plan, matchable_plan_keys, model_tp_plan
from .model_structure import attention_head_counts, retie_parameters, tied_parameter_names
from .partial_gradients import reduce_partial_gradients
from .pipeline_stages import whole_model
from .replica_check import check_replicated_gradients_once
from .sequence_parallel import (
    SequenceParallelLayout,
    install_sequence_parallel,
    sequence_parallel_layout,
    sequence_parallel_styles,
)
from .tp_styles import (
    TensorParallelLayer,
    for_module,
    install_module_style,
    packed_fused_projections,
    places_own_parameters,
    replicate_on_mesh,
    style_named,
)

__all__ = [
    "TPPlanChoice",
    "apply_tensor_parallel",
    "check_plan_rules",
    "check_tied_placements",
    "choose_tp_plan",
    "expanded_rules",
    "planned_styles",
    "resolve_tp_plan",
    "set_user_tp_plan",
    "validate_attention_heads",
]

logger = logging.getLogger(__name__)

TPPlan = dict[str, str]
PlanSpec = TPPlan | str | Callable[[nn.Module], TPPlan]
_KEY_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn")
# Where ``from_pretrained(tp_plan=...)`` / ``from_config(tp_plan=...)`` leave the user's plan on the model instance.
_USER_PLAN_ATTRIBUTE = "_automodel_user_tp_plan"


@dataclass(frozen=True)
class TPPlanChoice:
    """The plan TP applies and where it came from (``"from_pretrained(tp_plan=...)"``, the sidecar's class name, or
    ``"the model"``, or ``"derived from the module tree"``)."""

    plan: TPPlan
    source: str

    @property
    def from_user(self) -> bool:
        """Whether a user gave this plan (its unmatched rules are errors, not debug lines)."""
        return self.source == USER_SOURCE


USER_SOURCE = "from_pretrained(tp_plan=...)"
MODEL_SOURCE = "the model"


def set_user_tp_plan(model: nn.Module, plan: PlanSpec | None) -> None:
    """Record a user's TP plan on ``model``: it takes precedence over a sidecar's and the model's own.

    ``None`` and ``"auto"`` (transformers' spelling of "the model's own plan") record nothing.
    """
    if plan is None or (isinstance(plan, str) and plan == "auto"):
        return
    setattr(model, _USER_PLAN_ATTRIBUTE, plan)


def choose_tp_plan(
    model: nn.Module, sidecar_plan: PlanSpec | None, tp_size: int, sidecar: str = "the sidecar"
) -> TPPlanChoice:
    """The one TP plan for ``model``, by precedence: the user's (:func:`set_user_tp_plan`) > ``sidecar_plan`` > the
    model's own (``_tp_plan`` + ``config.base_model_tp_plan``) > one derived from its module tree for ``tp_size``
    ranks (:func:`derived_tp_plan.derive_tp_plan`); fused gate/up projections are packed
    (:func:`tp_styles.packed_fused_projections`).

    A plan may be a dict, a callable of the model, or the ``"module:attr"`` import path of either. Raises when the
    chosen plan is empty, and when none is declared and none can be derived, naming the class and why.
    """
    user = getattr(model, _USER_PLAN_ATTRIBUTE, None)
    if user is not None:
        plan, source = _materialize(user, model), USER_SOURCE
    elif sidecar_plan is not None:
        plan, source = _materialize(sidecar_plan, model), sidecar
    elif own := model_tp_plan(model):
        plan, source = own, MODEL_SOURCE
    else:
        # A pipeline stage takes the plan derived from the whole model: the same rules on every stage, with ties
        # across stages seen (rules naming other stages' modules are skipped when applied).
        plan, source = derive_tp_plan(whole_model(model), tp_size), DERIVED_SOURCE
    if not plan:
        raise ValueError(
            f"The TP plan from {source} for {type(model).__name__} is empty, so tp_size > 1 would shard nothing. Give "
            "it rules with transformers style names, or use tp_size=1."
        )
    return TPPlanChoice(packed_fused_projections(plan), source)


def resolve_tp_plan(model: nn.Module, override: PlanSpec | None = None) -> TPPlan:
    """``override`` materialized (a dict, a callable of the model, or its ``"module:attr"`` import path), else the
    model's own plan; raises when the result is empty."""
    plan = _materialize(override, model) if override is not None else model_tp_plan(model)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no `_tp_plan` on the class and no "
            "`base_model_tp_plan` on its config), so tp_size > 1 cannot shard it. Supply one, with transformers style "
            'names, e.g. {"model.layers.*.self_attn.q_proj": "colwise", ...}: pass `tp_plan=` to from_pretrained / '
            "from_config, set `_tp_plan` on a sidecar ModelParallelizer subclass "
            "(model_sidecars/<model>/parallelization.py), or pass `tp_shard_plan` to its `_apply`. Or use tp_size=1."
        )
    return plan


def _materialize(spec: PlanSpec, model: nn.Module) -> TPPlan:
    if isinstance(spec, str):
        module_name, _, attr = spec.replace(":", ".").rpartition(".")
        spec = getattr(importlib.import_module(module_name), attr)
    if callable(spec):
        spec = spec(model)
    return dict(spec)


def check_plan_rules(model: nn.Module, choice: TPPlanChoice) -> None:
    """A rule of a user's plan that addresses nothing in the model is an error naming it (a typo would otherwise
    silently leave a module unsharded); unmatched rules of a sidecar's or the model's own plan (which cover variants
    of an architecture) are logged at debug level."""
    keys = matchable_plan_keys(model)
    unmatched = [rule for rule in choice.plan if rule not in keys]
    if not unmatched:
        return
    if choice.from_user:
        raise ValueError(
            f"tp_plan rules {unmatched} match no parameter or module of {type(model).__name__}. Rules are full "
            "module or parameter names with `*` for layer numbers, e.g. 'model.layers.*.self_attn.q_proj'."
        )
    logger.debug("TP plan of %s: rules matching nothing in %s: %s", choice.source, type(model).__name__, unmatched)


def validate_attention_heads(model: nn.Module, tp_size: int, plan: TPPlan) -> None:
    """Raise when the plan shards attention heads that do not divide evenly over ``tp_size`` ranks."""
    expanded = expand_plan(model, plan)
    attention = next(
        (
            name.rpartition(".")[0]
            for name, style in expanded.items()
            if name.rpartition(".")[2] in _KEY_PROJECTIONS and "colwise" in style
        ),
        None,
    )
    if attention is None:
        return
    for label, count in attention_head_counts(model).items():
        if count % tp_size:
            raise ValueError(
                f"{attention}: {label}={count} is not divisible by tp_size={tp_size}, so its heads cannot be split "
                f"evenly over the TP ranks. Choose a tp_size that divides {count}."
            )


def expanded_rules(model: nn.Module, plan: TPPlan, sequence_parallel: bool) -> TPPlan:
    """``plan`` by exact module and parameter names, with LoRA adapters taking their base layers' placements, and
    without the stand-ins a pipeline stage holds for the modules other stages run (``lm_head`` before the last);
    raises for a style adapters cannot follow."""
    expanded = expand_plan(model, adapter_placements(model, expand_plan(model, plan), sequence_parallel))
    stand_ins = {name for name, module in model.named_modules() if getattr(module, "absent_from_stage", False)}
    return {name: style for name, style in expanded.items() if name not in stand_ins}


def planned_styles(
    model: nn.Module, expanded: TPPlan, sp_layout: SequenceParallelLayout | None
) -> dict[str, TensorParallelLayer]:
    """The style object of every exact name of ``expanded`` (in its sequence-parallel form under ``sp_layout``), in the
    form its module takes (a ``Conv1D`` its transposed form); raises, naming it, for a style that cannot apply."""
    styles = {name: style_named(style) for name, style in expanded.items()}
    if sp_layout is not None:
        styles = sequence_parallel_styles(sp_layout, styles)
    modules = dict(model.named_modules())
    return {
        name: for_module(modules[name if name in modules else name.rpartition(".")[0]], style, name)
        for name, style in styles.items()
    }


def check_tied_placements(model: nn.Module, styles: dict[str, TensorParallelLayer], mesh: DeviceMesh) -> None:
    """Refuse a plan that would shard the parameters of one tied group differently, touching nothing: each styled
    tied parameter is sharded on a parameter-free meta twin of its module."""
    tied = [group for group in tied_parameter_names(model) if any(name in styles for name in group)]
    for names in tied:
        placements = {name: _placement_after(model, name, styles.get(name), mesh) for name in names}
        if len(set(placements.values())) > 1:
            raise ValueError(
                f"Tied parameters {names} would be sharded differently by the TP plan ({placements}); give them "
                "the same placement in the plan or untie them (tie_word_embeddings=False)."
            )


def _placement_after(model: nn.Module, name: str, style: TensorParallelLayer | None, mesh: DeviceMesh) -> tuple:
    if style is None:
        return (Replicate(),)
    module_name, _, param_name = name.rpartition(".")
    twin = copy.copy(model.get_submodule(module_name))
    twin._parameters = {
        key: None if value is None else nn.Parameter(torch.empty_like(value, device="meta"), value.requires_grad)
        for key, value in twin._parameters.items()
    }
    style.shard_param(twin, param_name, mesh)
    return tuple(getattr(twin._parameters[param_name], "placements", (Replicate(),)))


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool,
    owned_elsewhere: list[str] = (),
    check_gradients: bool = False,
) -> None:
    """Shard parameters and install the forward transforms of every plan entry on ``tp_mesh`` (the plan was checked
    by the planner: :func:`expanded_rules`, :func:`planned_styles`, :func:`check_tied_placements`).

    With ``check_gradients`` (on for a derived plan) the first backward checks that every replicated parameter got
    the same gradient on every TP rank (:mod:`replica_check`).

    With ``sequence_parallel`` the decoder layers run on sequence shards (:mod:`sequence_parallel`). Parameters the
    plan does not shard become replicated DTensors on ``tp_mesh`` (:func:`tp_styles.replicate_on_mesh`), except
    inside the modules named in ``owned_elsewhere`` (the routed experts EP places next). Tied parameters stay one
    ``Parameter``.
    """
    tied = tied_parameter_names(model)
    expanded = expanded_rules(model, plan, sequence_parallel)
    sp_layout = sequence_parallel_layout(model, expanded) if sequence_parallel else None
    styles = planned_styles(model, expanded, sp_layout)
    if sp_layout is not None:
        install_sequence_parallel(model, sp_layout, tp_mesh)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, style in styles.items():
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            style.shard_param(modules[module_name], param_name, tp_mesh)
    retie_parameters(model, tied)
    # Every other parameter becomes a replicated DTensor on the TP mesh, computed on as its local tensor, so that all
    # parameters live on one mesh (torch's clip_grad_norm_ and foreach optimizers need that); before the styles are
    # installed, so that they wrap the local-tensor forward.
    own_placement = [
        modules[name] for name, style in styles.items() if name in modules and places_own_parameters(style)
    ]
    elsewhere = [inner for name in owned_elsewhere for inner in modules[name].modules()]
    replicate_on_mesh(model, tp_mesh, skip=own_placement + elsewhere)
    for name, style in styles.items():
        if name in modules:
            install_module_style(model, modules[name], style, tp_mesh)
    reduce_partial_gradients(model, tp_mesh, styles)
    if check_gradients:
        check_replicated_gradients_once(model, tp_mesh)
