"""transformers' plans on models (supported range in pyproject.toml): the TP plan with its named styles, the EP plan and
the FSDP plan.

transformers ships named TP styles (``ALL_PARALLEL_STYLES``: ``"colwise"``, ``"rowwise"``, ``"packed_colwise"``,
``"embedding_rowwise"`` ...) and plans on models (``model.tp_plan``: ``_tp_plan`` + ``config.base_model_tp_plan``,
``ep_plan``, ``fsdp_plan``). This module reads and expands the plans; the private transformers symbols it and
``tp_styles`` build on come from the one seam, :mod:`automodel._compat.transformers`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel._compat.transformers import (
    ALL_PARALLEL_STYLES,
    EpDispatchExpertsParallel,
    get_parameter_plan,
    replace_layer_number_by_wildcard,
)

from .tp_styles import hand_back_owned_outputs

__all__ = [
    "EXPERT_DISPATCH_STYLE",
    "EXPERT_STYLES",
    "expand_plan",
    "install_expert_parallel",
    "matchable_plan_keys",
    "model_ep_plan",
    "model_fsdp_plan",
    "model_tp_plan",
    "module_style",
]


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own TP plan with wildcards and full module prefixes (empty when it has none)."""
    plan = getattr(model, "tp_plan", None)
    if plan is None:
        plan = getattr(model, "_tp_plan", None)
    return dict(plan or {})


def model_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers expert-parallel plan (``config.base_model_ep_plan`` + ``_ep_plan``), or empty."""
    return dict(getattr(model, "ep_plan", None) or {})


#: The EP plan style of a routed-experts module whose tokens are dispatched to the experts' owners.
EXPERT_DISPATCH_STYLE = "ep_dispatch_experts"
#: The EP plan styles that place routed experts: their weights split whole-expert (``grouped_gemm``) and the module
#: that dispatches tokens to them. Other entries of a model's ``ep_plan`` (some shard dense MLPs over the EP mesh, for
#: transformers' own EP, where the EP group holds one batch) are not expert placements: TP and FSDP own those modules.
EXPERT_STYLES = frozenset({"grouped_gemm", EXPERT_DISPATCH_STYLE})
# Importing transformers' EP module registers these styles in ALL_PARALLEL_STYLES.
assert isinstance(ALL_PARALLEL_STYLES[EXPERT_DISPATCH_STYLE], EpDispatchExpertsParallel)


def install_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Shard the plan's expert weights over ``ep_mesh`` (``Shard(0)``: whole experts per rank) and route each
    experts module's tokens to their owners with transformers' all-to-all dispatcher.

    ``plan`` is expanded (no wildcards) and names every alias of a shared parameter and every module sharing its
    experts' parameters (twin layers), so that each gets the placement and the dispatch; the caller re-ties the
    aliases afterwards. This is transformers' ``apply_expert_parallelism`` loop, which looks parameters up without
    their aliases. The dispatcher handles uneven and empty token counts (an experts module that receives no rows
    still runs backward, so FSDP's reduction and the reverse all-to-all take place on every rank); ``tp_mesh`` is the
    group holding one batch, whose ranks each dispatch a disjoint slice of it.
    """
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, style_name in plan.items():
        style = ALL_PARALLEL_STYLES[style_name]
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            style.validate_param(modules[module_name], param_name, ep_mesh, parameter_name=name)
            style.shard_param(modules[module_name], param_name, ep_mesh)
        elif style_name == EXPERT_DISPATCH_STYLE:
            style.install_forward(modules[name], ep_mesh=ep_mesh, tp_mesh=tp_mesh, ep_implementation="all_to_all")
            # With TP the combined output is a ``to_local`` view, and these modules become FSDP units.
            hand_back_owned_outputs(modules[name])
        else:
            style.install_forward(modules[name], ep_mesh)


def matchable_plan_keys(model: nn.Module) -> set[str]:
    """Every plan key that addresses something in ``model``: each parameter and module name, exactly and with its
    layer numbers as ``*``, and each parameter's module (a plan entry on a module covers its weights)."""
    keys: set[str] = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        module_name = name.rpartition(".")[0]
        keys.update((name, replace_layer_number_by_wildcard(name)))
        if module_name:
            keys.update((module_name, replace_layer_number_by_wildcard(module_name)))
    for name, _ in model.named_modules():
        if name:
            keys.update((name, replace_layer_number_by_wildcard(name)))
    return keys


def model_fsdp_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers FSDP plan (``"free_full_weight"`` / ``"keep_full_weight"`` per module name)."""
    return dict(getattr(model, "fsdp_plan", None) or {})


def module_style(module_name: str, plan: dict[str, str]) -> str | None:
    """The style a plan (with ``*`` wildcards) gives the module ``module_name``, or ``None``."""
    return _plan_style(module_name, plan, is_weight=False)


def _plan_style(name: str, plan: dict[str, str], *, is_weight: bool) -> str | None:
    """The plan's style for a parameter (or its module) or a module: an entry naming it exactly, else transformers'
    lookup, which reads every layer number as ``*`` (so it cannot address one element of a list, e.g. ``to_out.0``
    beside a dropout ``to_out.1``)."""
    if name in plan:
        return plan[name]
    if is_weight and "." in name and (module_name := name.rsplit(".", 1)[0]) in plan:
        return plan[module_name]
    return get_parameter_plan(name, plan, is_weight=is_weight)


def expand_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Replace the plan's ``*`` with real layer numbers: one entry per matching parameter, then its module. Entries
    may also name a module exactly.

    Tied parameters appear under every name (``named_parameters(recurse=False)`` of each module), so the caller can
    shard each alias consistently.
    """
    expanded: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if (style := _plan_style(name, plan, is_weight=True)) is not None:
                expanded[name] = style
        if module_name and (style := _plan_style(module_name, plan, is_weight=False)) is not None:
            expanded[module_name] = style
    return expanded
