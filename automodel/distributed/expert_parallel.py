"""Expert parallelism: routed experts split over the ``ep`` axis and sharded over ``ep_shard``.

transformers 5.24 provides the pieces that fit: the models' own ``ep_plan`` (``grouped_gemm`` weights +
``ep_dispatch_experts`` modules) and an all-to-all token dispatcher (see ``hf_plans.install_expert_parallel``). This
module decides where they apply, validates the layout before anything is touched, and gives the experts their FSDP
units with the gradient scaling that makes them match the dense weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel._compat.transformers import replace_layer_number_by_wildcard

from .hf_plans import (
    EXPERT_DISPATCH_STYLE,
    EXPERT_STYLES,
    expand_plan,
    install_expert_parallel,
    model_ep_plan,
)
from .model_structure import retie_parameters, tied_module_groups, tied_parameter_names
from .pipeline_stages import whole_model

__all__ = [
    "apply_expert_parallel",
    "drop_expert_rules",
    "expert_module_names",
    "expert_plan",
    "shard_experts",
    "validate_experts",
]


def expert_plan(model: nn.Module) -> dict[str, str]:
    """The expert placements of the model's EP plan, expanded: every ``grouped_gemm`` weight and ``ep_dispatch_experts``
    module, plus the other names of those weights and the modules that share them (twin layers holding the same
    experts), which must be placed and dispatched alike."""
    plan = {name: style for name, style in expand_plan(model, model_ep_plan(model)).items() if style in EXPERT_STYLES}
    tied = tied_parameter_names(model)
    if not tied:
        return plan
    aliases = {name: group for group in tied for name in group}
    placed = dict(plan)
    for name, style in plan.items():
        for alias in aliases.get(name, ()):
            placed.setdefault(alias, style)
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style != EXPERT_DISPATCH_STYLE:
            continue
        own = {id(param) for param in modules[name].parameters()}
        for other_name, other in modules.items():
            if other_name not in placed and own and {id(param) for param in other.parameters()} == own:
                placed[other_name] = style
    return placed


def expert_module_names(model: nn.Module) -> list[str]:
    """Names of the routed-experts modules the model's EP plan dispatches tokens to (wildcards expanded, twins
    included)."""
    return [name for name, style in expert_plan(model).items() if style == EXPERT_DISPATCH_STYLE]


def validate_experts(model: nn.Module, ep_size: int, tp_size: int) -> list[str]:
    """Raise a clear error when ``model`` cannot be split over ``ep_size`` expert-parallel ranks; return the names of
    its experts modules. A pipeline stage is judged as the whole model it was cut from: a stage that holds none of the
    model's experts (Nemotron-H's first blocks) has nothing to split, and is not refused for it."""
    if ep_size % tp_size:
        raise ValueError(
            f"ep_size={ep_size} must be a multiple of tp_size={tp_size}: the TP ranks share one batch and each "
            "dispatches a slice of it, so a TP group must lie inside one expert-parallel group."
        )
    names = expert_module_names(model)
    if not names and not expert_module_names(whole_model(model)):
        raise ValueError(
            f"ep_size={ep_size}, but {type(model).__name__} has no routed experts in an expert-parallel plan (no "
            f"'{EXPERT_DISPATCH_STYLE}' module in `model.ep_plan` / `config.base_model_ep_plan`). Use ep_size=1 "
            "(FSDP2 and TP shard the experts like dense weights), or give the model an ep_plan."
        )
    for name in names:
        experts = model.get_submodule(name)
        count = getattr(experts, "num_experts", None)
        if count is None:
            count = next(experts.parameters()).shape[0]
        if count % ep_size:
            raise ValueError(
                f"{name} has {count} experts, which do not divide over ep_size={ep_size} ranks. Choose an ep_size "
                f"that divides {count}."
            )
    return names


def drop_expert_rules(plan: dict[str, Any], expert_names: list[str]) -> dict[str, Any]:
    """The TP plan without its rules for the experts (and their weights), which EP owns instead.

    ``plan`` may use ``*`` wildcards; a rule is dropped when it names an experts module or anything inside one.
    """
    patterns = {replace_layer_number_by_wildcard(name) for name in expert_names} | set(expert_names)
    return {
        key: style
        for key, style in plan.items()
        if not any(key == pattern or key.startswith(pattern + ".") for pattern in patterns)
    }


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[list[nn.Module]]:
    """Split every routed-experts module of ``model`` over ``ep_mesh``; return those modules, grouped with the twins
    they share their experts with (each group becomes one FSDP unit)."""
    plan = expert_plan(model)
    tied = tied_parameter_names(model)
    install_expert_parallel(model, ep_mesh, tp_mesh, plan)
    retie_parameters(model, tied)
    experts = [model.get_submodule(name) for name, style in plan.items() if style == EXPERT_DISPATCH_STYLE]
    return tied_module_groups(experts)


def shard_experts(
    groups: list[list[nn.Module]],
    shard: Callable[..., Any],
    *,
    mesh: DeviceMesh,
    batches_per_step: int,
    **options: Any,
) -> None:
    """Make each group of experts modules one FSDP unit over ``mesh`` (``ep_shard``), before the dense units.

    An expert's gradient sums the contributions of every token routed to it from its whole EP group, and FSDP sums
    those over ``ep_shard``: the result covers all ``batches_per_step`` distinct batches of the step (every rank but
    TP replicas). Dividing by that count makes it the same mean over the global batch as the dense gradients.
    """
    for group in groups:
        shard(group[0] if len(group) == 1 else group, mesh=mesh, **options)
        unit = group[0]  # the members of a group share one FSDP state
        unit.set_gradient_divide_factor(float(batches_per_step))
        if mesh.size() > 1:
            # FSDP2 applies a factor other than the group size through NCCL's PREMUL_SUM, which gloo lacks: reduce
            # with a plain SUM and divide locally instead. A size-1 mesh has no reduce-scatter and FSDP2 already
            # divides, so forcing the sum there would divide twice.
            unit.set_force_sum_reduction_for_comms(True)
