"""The one place that touches transformers' tensor-parallel internals (supported range pinned in pyproject.toml).

transformers ships named TP styles (``ALL_PARALLEL_STYLES``: ``"colwise"``, ``"rowwise"``, ``"packed_colwise"``,
``"embedding_rowwise"`` ...) and plans on models (``model.tp_plan``: ``_tp_plan`` + ``config.base_model_tp_plan``). We
use both as they are. What transformers does not have yet is sequence parallelism (``enable_sequence_parallel`` is
"not wired up" in 5.24), so the sequence-parallel variants of its rowwise and norm styles live here too.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from transformers.distributed.expert_parallel import EpDispatchExpertsParallel
from transformers.distributed.parallel_utils import (
    ALL_PARALLEL_STYLES,
    _get_parameter_plan,
    replace_layer_number_by_wildcard,
)
from transformers.distributed.tensor_parallel import (
    MlaKvAProjParallel,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    SequenceParallel,
    TensorParallelLayer,
)

__all__ = [
    "EXPERT_DISPATCH_STYLE",
    "EXPERT_STYLES",
    "SequenceParallelNorm",
    "SequenceParallelRowwise",
    "TensorParallelLayer",
    "expand_plan",
    "install_expert_parallel",
    "install_module_style",
    "matchable_plan_keys",
    "model_ep_plan",
    "model_fsdp_plan",
    "model_tp_plan",
    "module_style",
    "replace_layer_number_by_wildcard",
    "style_named",
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
        else:
            style.install_forward(modules[name], ep_mesh)


def install_module_style(model: nn.Module, module: nn.Module, style: TensorParallelLayer, mesh: DeviceMesh) -> None:
    """Install a TP style's forward transforms on ``module``, as transformers' ``apply_tensor_parallelism`` does.

    transformers' MLA style (``mla_kv_a_proj``) reads the text config from the module it is installed on, which
    transformers' own TP sets first; so does this.
    """
    if isinstance(style, MlaKvAProjParallel):
        config = getattr(model, "config", None)
        module.config = config.get_text_config() if hasattr(config, "get_text_config") else config
    style.install_forward(module, mesh)


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
    return _get_parameter_plan(name, plan, is_weight=is_weight)


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


def style_named(name: str) -> TensorParallelLayer:
    """The transformers style object registered under ``name`` (``replicated_with_grad_allreduce``: our variant that
    reduces a shared parameter's gradient once)."""
    if name not in ALL_PARALLEL_STYLES:
        raise ValueError(f"Unknown tensor-parallel style {name!r}; transformers knows {sorted(ALL_PARALLEL_STYLES)}.")
    if name == "replicated_with_grad_allreduce":
        return _REPLICATED_WITH_GRAD_ALLREDUCE_ONCE
    return ALL_PARALLEL_STYLES[name]


class ReplicatedWithGradAllReduceOnce(ReplicatedWithGradAllReduce):
    """transformers' ``replicated_with_grad_allreduce`` (a replicated parameter whose gradient is summed over TP),
    with each parameter's gradient reduced once even when several modules share it.

    transformers records the hooks it registered per module, so a parameter two modules share (tied encoder / decoder
    layers) gets one all-reduce hook per module, and its gradient is summed over the TP ranks twice.
    """

    _hooked: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        original_forward = module.forward
        hooked = ReplicatedWithGradAllReduceOnce._hooked

        def all_reduce_grad(param: torch.Tensor) -> None:
            dist.all_reduce(param.grad, group=mesh.get_group())

        def tp_forward(*args, **kwargs):
            # Parameters are replaced by the loaded weights after setup, so hooks are attached at the first forward.
            if torch.is_grad_enabled():
                for param in module.parameters(recurse=False):
                    if param.requires_grad and hooked.get(id(param)) is not param:
                        param.register_post_accumulate_grad_hook(all_reduce_grad)
                        hooked[id(param)] = param
            return original_forward(*args, **kwargs)

        module.forward = tp_forward
        return module


_REPLICATED_WITH_GRAD_ALLREDUCE_ONCE = ReplicatedWithGradAllReduceOnce()


class SequenceParallelRowwise(RowwiseParallel):
    """Rowwise linear that reduce-scatters its partial output onto sequence shards instead of all-reducing it."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(-1), output_layouts=Shard(1))

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return False


class SequenceParallelNorm(SequenceParallel):
    """A per-token module (norm) run on sequence shards; its replicated weight gets its gradient summed over TP."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=1, use_local_output=True)
