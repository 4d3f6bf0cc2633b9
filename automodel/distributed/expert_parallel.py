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

from .hf_plans import (
    EXPERT_DISPATCH_STYLE,
    expand_plan,
    install_expert_parallel,
    model_ep_plan,
    replace_layer_number_by_wildcard,
)

__all__ = ["apply_expert_parallel", "drop_expert_rules", "expert_module_names", "shard_experts", "validate_experts"]


def expert_module_names(model: nn.Module) -> list[str]:
    """Names of the routed-experts modules the model's EP plan dispatches tokens to (wildcards expanded)."""
    plan = expand_plan(model, model_ep_plan(model))
    return [name for name, style in plan.items() if style == EXPERT_DISPATCH_STYLE]


def validate_experts(model: nn.Module, ep_size: int, tp_size: int) -> list[str]:
    """Raise a clear error when ``model`` cannot be split over ``ep_size`` expert-parallel ranks; return the names of
    its experts modules."""
    if ep_size % tp_size:
        raise ValueError(
            f"ep_size={ep_size} must be a multiple of tp_size={tp_size}: the TP ranks share one batch and each "
            "dispatches a slice of it, so a TP group must lie inside one expert-parallel group."
        )
    names = expert_module_names(model)
    if not names:
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
    patterns = {replace_layer_number_by_wildcard(name) for name in expert_names}
    return {
        key: style
        for key, style in plan.items()
        if not any(key == pattern or key.startswith(pattern + ".") for pattern in patterns)
    }


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every routed-experts module of ``model`` over ``ep_mesh``; return those modules."""
    plan = expand_plan(model, model_ep_plan(model))
    install_expert_parallel(model, ep_mesh, tp_mesh, plan)
    return [model.get_submodule(name) for name, style in plan.items() if style == EXPERT_DISPATCH_STYLE]


def shard_experts(
    experts: list[nn.Module],
    shard: Callable[..., nn.Module],
    *,
    mesh: DeviceMesh,
    batches_per_step: int,
    **options: Any,
) -> None:
    """Make each experts module its own FSDP unit over ``mesh`` (``ep_shard``), before the dense units.

    An expert's gradient sums the contributions of every token routed to it from its whole EP group, and FSDP sums
    those over ``ep_shard``: the result covers all ``batches_per_step`` distinct batches of the step (every rank but
    TP replicas). Dividing by that count makes it the same mean over the global batch as the dense gradients.
    """
    for module in experts:
        shard(module, mesh=mesh, **options)
        module.set_gradient_divide_factor(float(batches_per_step))
        if mesh.size() > 1:
            # FSDP2 applies a factor other than the group size through NCCL's PREMUL_SUM, which gloo lacks: reduce
            # with a plain SUM and divide locally instead. A size-1 mesh has no reduce-scatter and FSDP2 already
            # divides, so forcing the sum there would divide twice.
            module.set_force_sum_reduction_for_comms(True)
