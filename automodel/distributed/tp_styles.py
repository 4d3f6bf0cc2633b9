"""transformers' TP styles as the shared TP step installs them, with what makes them hold for every model.

transformers' styles are used as they are, by name, except where a model's plan meets a case the style alone gets
wrong (each found by the sweep over transformers' causal-LM mapping, ``tests/test_zoo_sweep.py``):

- a replicated parameter shared by several modules gets its gradient summed over TP once, not once per module;
- sequence parallelism, which transformers 5.24 has not wired up: rowwise projections reduce-scatter onto sequence
  shards, norms run on them;
- the MLA style reads the text config from its module, which transformers' own TP attaches first;
- an embedding subclass that post-processes its lookup (normalizes it) gets the embedding style on the lookup, so the
  post-processing sees the reduced embedding rather than a pending partial sum;
- an ``all_reduce`` module whose own parameters the plan shards runs as a whole partial-sum block (local shards,
  input gradients summed, output summed), not only with its output summed;
- TP outputs are handed back as tensors the model may update in place (``out.add_(...)``), not as the views
  ``DTensor.to_local`` returns, which autograd forbids modifying;
- ``colwise`` on a fused ``*gate_up_proj`` (gate and up concatenated, read back with ``chunk(2)``) becomes
  ``packed_colwise``, as every other transformers plan has it, so each rank holds matching gate and up columns;
- ``colwise`` and ``rowwise`` on a GPT-2 ``Conv1D`` (a linear layer whose weight is stored ``(in, out)``) shard the
  weight's other dimension (:func:`for_module`); other sharding styles on it are refused.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from automodel._compat.torch import is_to_local_view, tree_map_only
from automodel._compat.transformers import (
    ALL_PARALLEL_STYLES,
    AllReduceParallel,
    ColwiseParallel,
    EmbeddingParallel,
    MlaKvAProjParallel,
    PackedColwiseParallel,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    SequenceParallel,
    TensorParallelLayer,
    all_reduce_backward,
    all_reduce_forward,
    local_dtensor_params,
)

__all__ = [
    "REPLICATED_WITH_GRAD_ALLREDUCE_ONCE",
    "hand_back_owned_outputs",
    "is_replicated",
    "owned_local",
    "places_own_parameters",
    "replicate_on_mesh",
    "ReplicatedWithGradAllReduceOnce",
    "SequenceParallelNorm",
    "SequenceParallelRowwise",
    "TensorParallelLayer",
    "for_module",
    "install_module_style",
    "is_conv1d",
    "packed_fused_projections",
    "shards_output",
    "style_named",
]

logger = logging.getLogger(__name__)

_FUSED_GATE_UP = "gate_up_proj"


def style_named(name: str) -> TensorParallelLayer:
    """The transformers style object registered under ``name`` (``replicated_with_grad_allreduce``: our variant that
    reduces a shared parameter's gradient once), or one of ours (:data:`OUR_STYLES`)."""
    if name in OUR_STYLES:
        return OUR_STYLES[name]
    if name not in ALL_PARALLEL_STYLES:
        raise ValueError(f"Unknown tensor-parallel style {name!r}; transformers knows {sorted(ALL_PARALLEL_STYLES)}.")
    return ALL_PARALLEL_STYLES[name]


def packed_fused_projections(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with ``colwise`` on fused gate/up projections (``*gate_up_proj``) made ``packed_colwise``."""
    fixed = {
        key: "packed_colwise" if key.endswith(_FUSED_GATE_UP) and style == "colwise" else style
        for key, style in plan.items()
    }
    changed = [key for key in plan if fixed[key] != plan[key]]
    if changed:
        logger.info("TP plan: %s shard fused gate/up projections, so they use 'packed_colwise', not 'colwise'", changed)
    return fixed


def is_conv1d(module: nn.Module) -> bool:
    """A GPT-2-style ``Conv1D``: ``addmm(bias, x, weight)`` with ``weight`` of shape ``(nx, nf)`` = (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def for_module(module: nn.Module, style: TensorParallelLayer, name: str) -> TensorParallelLayer:
    """The form of ``style`` to use on ``module`` (a plan entry ``name`` resolves to it): a ``Conv1D`` takes the
    transposed-weight form of colwise and rowwise; a style that shards another way is refused on it, naming it."""
    if not is_conv1d(module):
        return style
    if isinstance(style, (Conv1DColwise, Conv1DRowwise)):
        return style
    if type(style) is ColwiseParallel and isinstance(style.output_layouts, Shard):
        return Conv1DColwise(output_layouts=style.output_layouts, use_local_output=style.use_local_output)
    if isinstance(style, RowwiseParallel) and type(style) in (RowwiseParallel, SequenceParallelRowwise):
        return Conv1DRowwise(output_layouts=style.output_layouts, use_local_output=style.use_local_output)
    if type(style).shard_param is TensorParallelLayer.shard_param:  # replicated styles leave the weight alone
        return style
    raise ValueError(
        f"{name} is a Conv1D (weight stored (in, out)) and its TP plan style is {type(style).__name__}, which shards "
        "a linear layer's (out, in) weight: use 'colwise' or 'rowwise' on it (both take the Conv1D form), or leave "
        "it out of the plan (replicated)."
    )


def places_own_parameters(style: TensorParallelLayer) -> bool:
    """Whether installing ``style`` on a module turns the module's own parameters into DTensors itself (transformers'
    sequence-parallel style replicates a norm's weight and computes on DTensors)."""
    return isinstance(style, SequenceParallel)


def is_replicated(tensor: torch.Tensor) -> bool:
    """A DTensor replicated on every dimension of its mesh."""
    return isinstance(tensor, DTensor) and all(isinstance(placement, Replicate) for placement in tensor.placements)


def replicate_on_mesh(model: nn.Module, mesh: DeviceMesh, *, skip: list[nn.Module]) -> None:
    """Make every plain parameter of ``model`` (outside the modules in ``skip``) a DTensor replicated on ``mesh``, and
    let the model compute on their local tensors, exactly as before (their gradients come back as replicated
    DTensors, identical on every rank of ``mesh``). Shared parameters stay shared.

    Then every parameter of a TP model is a DTensor on the TP mesh (and, once FSDP2 shards them, on one 2-D mesh), as
    torchtitan has it: ``torch.nn.utils.clip_grad_norm_`` and foreach / fused optimizers work on them.
    """
    skipped = {id(module) for module in skip}
    replicas: dict[int, nn.Parameter] = {}
    slots: dict[int, list[str]] = {}
    for module in model.modules():
        if id(module) in skipped:
            continue
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in replicas:
                data = distribute_tensor(param.detach(), mesh, [Replicate()], src_data_rank=None)
                replicas[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = replicas[id(param)]
            slots.setdefault(id(module), []).append(name)
    if slots:
        _compute_on_local_replicas(model, slots)


def _compute_on_local_replicas(model: nn.Module, slots: dict[int, list[str]]) -> None:
    """Wrap the forward of every module whose subtree holds a replica so that, while it runs, the replicas of its
    subtree are their local tensors (a module may read a child's weight directly, as a Mamba mixer reads its
    convolution's); each wrapper puts back what it swapped.

    Only replicas that are whole on the wrapper's call are swapped: FSDP2's sharded parameters of an inner unit are
    not (they are swapped inside that unit, after FSDP2 has gathered them). The wrappers are installed before
    activation checkpointing, so a recomputation runs them too.
    """
    for module in model.modules():
        covered = [(sub, name) for sub in module.modules() if id(sub) in slots for name in slots[id(sub)]]
        if covered:
            _swap_replicas_around_forward(module, covered)


def _swap_replicas_around_forward(module: nn.Module, covered: list[tuple[nn.Module, str]]) -> None:
    # Inside the checkpoint of a module checkpointed already (a sidecar's early checkpointing), so it runs in the
    # recomputation too.
    attribute = "_automodel_checkpointed_forward" if hasattr(module, "_automodel_checkpointed_forward") else "forward"
    forward = getattr(module, attribute)
    deferred: set[int] | None = None  # found on the first call, when activation checkpointing has been applied

    @functools.wraps(forward)  # the signature stays the model's: generate() validates its keywords against it
    def forward_on_local_replicas(*args: Any, **kwargs: Any) -> Any:
        nonlocal deferred
        if deferred is None:
            deferred = _inside_checkpointed_descendants(module)
        swapped = [
            (sub, name, sub._parameters[name])
            for sub, name in covered
            if id(sub) not in deferred and is_replicated(sub._parameters[name])
        ]
        for sub, name, param in swapped:
            sub._parameters[name] = param.to_local()
        try:
            return forward(*args, **kwargs)
        finally:
            for sub, name, param in swapped:
                sub._parameters[name] = param

    setattr(module, attribute, forward_on_local_replicas)


def _inside_checkpointed_descendants(module: nn.Module) -> set[int]:
    """The modules inside a checkpointed strict descendant of ``module``: that descendant's own wrapper swaps their
    replicas, inside its checkpoint, so that its forward and its recomputation run the same ops (selective
    checkpointing replays them one by one; a swap done outside in forward but inside in the recomputation would add
    ``to_local`` views to the recomputation only)."""
    inside: set[int] = set()
    for descendant in module.modules():
        if descendant is not module and getattr(descendant, "_automodel_checkpointed", False):
            inside |= {id(sub) for sub in descendant.modules()}
    return inside


def shards_output(style: TensorParallelLayer) -> bool:
    """Whether ``style`` hands back this rank's slice of its output features (colwise styles that do not gather)."""
    if isinstance(style, PackedColwiseParallel):
        return style.use_local_output
    return isinstance(style, ColwiseParallel) and isinstance(style.output_layouts, Shard) and style.use_local_output


def install_module_style(model: nn.Module, module: nn.Module, style: TensorParallelLayer, mesh: DeviceMesh) -> None:
    """Install a TP style's forward transforms on ``module`` (its parameters are sharded already)."""
    if isinstance(style, MlaKvAProjParallel):
        config = getattr(model, "config", None)
        module.config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if isinstance(style, EmbeddingParallel) and _post_processes_lookup(module):
        _install_on_lookup(module, style, mesh)
    elif isinstance(style, AllReduceParallel) and _owns_sharded_parameters(module):
        _install_partial_sum_block(module, mesh)
    else:
        style.install_forward(module, mesh)
    hand_back_owned_outputs(module)


def _post_processes_lookup(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


def _install_on_lookup(module: nn.Module, style: TensorParallelLayer, mesh: DeviceMesh) -> None:
    """Put the style around ``nn.Embedding.forward`` itself: the module's class becomes a subclass whose MRO places a
    lookup class between the model's embedding class and ``nn.Embedding``, so the model's ``super().forward()`` reaches
    the styled lookup (the way FSDP2 swaps in ``FSDP<Class>``)."""

    class StyledLookup(nn.Embedding):
        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            args, kwargs = style.transform_inputs_pre_forward(self, args, kwargs, mesh)
            with style.context_around_forward(self, mesh):
                output = nn.Embedding.forward(self, *args, **kwargs)
            return style.transform_output_post_forward(self, output, mesh)

    cls = type(module)
    module.__class__ = type(cls.__name__, (cls, StyledLookup), {"__module__": cls.__module__})


def _owns_sharded_parameters(module: nn.Module) -> bool:
    """Whether the plan sharded ``module``'s own parameters; all of them must be, for a partial-sum block."""
    own = dict(module.named_parameters(recurse=False))
    sharded = {name for name, param in own.items() if isinstance(param, DTensor)}
    if sharded and sharded != set(own):
        raise ValueError(
            f"{type(module).__name__} has the TP style 'all_reduce' and the plan shards only some of its parameters "
            f"({sorted(sharded)} of {sorted(own)}): its partial outputs would add the replicated ones once per TP rank. "
            "Shard all of its parameters, or none, in the TP plan."
        )
    return bool(sharded)


def _install_partial_sum_block(module: nn.Module, mesh: DeviceMesh) -> None:
    """Run ``module`` on its local parameter shards as one partial-sum block: the gradients of its (replicated) tensor
    inputs are summed over TP, and so is its output (``moe_tp_experts`` does the same for routed experts)."""
    forward, group = module.forward, mesh.get_group()

    def sum_input_grads(value: Any) -> Any:
        return all_reduce_backward(value, group) if isinstance(value, torch.Tensor) else value

    @functools.wraps(forward)
    def partial_sum_forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(sum_input_grads(arg) for arg in args)
        kwargs = {key: sum_input_grads(value) for key, value in kwargs.items()}
        with local_dtensor_params(module):
            output = forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda tensor: _sum_floats(tensor, group), output)

    module.forward = partial_sum_forward


def _sum_floats(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    return all_reduce_forward(tensor, group) if tensor.is_floating_point() else tensor


class _Owned(torch.autograd.Function):
    """An alias of a tensor that is not a view of it (gradient passed through): the model may modify it in place."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def owned_local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an owned alias when it is a view ``DTensor.to_local`` returned (of a temporary that nothing else
    references): no copy, and the model may modify it in place as without TP. An FSDP2 unit returning it keeps the
    backward hook FSDP2 puts on its output through such an update (FSDP2 warns about every view a unit
    returns)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        # Without autograd nothing tracks the view; in a compiled block AOTAutograd functionalizes in-place updates
        # of views (and `_is_view` cannot be traced).
        return tensor
    return _Owned.apply(tensor) if is_to_local_view(tensor) else tensor


def hand_back_owned_outputs(module: nn.Module) -> None:
    """Wrap ``module.forward`` so that outputs ``DTensor.to_local`` returned come back as owned aliases
    (``owned_local``)."""
    forward = module.forward

    @functools.wraps(forward)
    def forward_with_owned_outputs(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, owned_local, output) if torch.is_grad_enabled() else output

    module.forward = forward_with_owned_outputs


class ReplicatedWithGradAllReduceOnce(ReplicatedWithGradAllReduce):
    """transformers' ``replicated_with_grad_allreduce`` (a replicated parameter whose gradient is summed over TP),
    with each parameter's gradient reduced once even when several modules share it.

    transformers records the hooks it registered per module, so a parameter two modules share (tied encoder / decoder
    layers) gets one all-reduce hook per module, and its gradient is summed over the TP ranks twice.
    """

    _hooked: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        original_forward = module.forward

        @functools.wraps(original_forward)
        def tp_forward(*args, **kwargs):
            # Parameters are replaced by the loaded weights after setup, so hooks are attached at the first forward.
            if torch.is_grad_enabled():
                self.hook_parameters(module, mesh)
            return original_forward(*args, **kwargs)

        module.forward = tp_forward
        return module

    @classmethod
    @torch.compiler.disable  # registers hooks: runs eagerly (a graph break) inside a compiled block
    def hook_parameters(cls, module: nn.Module, mesh: DeviceMesh) -> None:
        """Sum the gradients of ``module``'s own trainable parameters over ``mesh``, each once: on the parameter when
        it is a leaf, on the local tensor a replica is computed with otherwise (``replicate_on_mesh``)."""
        for param in module._parameters.values():
            if param is None or not param.requires_grad or cls._hooked.get(id(param)) is param:
                continue
            if param.is_leaf:
                param.register_post_accumulate_grad_hook(_all_reduce_grad(mesh))
            else:
                param.register_hook(_summed_over(mesh))
            cls._hooked[id(param)] = param


def _summed_over(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        return grad

    return hook


def _all_reduce_grad(mesh: DeviceMesh) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad  # a replica: its local tensor
        dist.all_reduce(grad, group=mesh.get_group())

    return hook


REPLICATED_WITH_GRAD_ALLREDUCE_ONCE = ReplicatedWithGradAllReduceOnce()


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


class ReplicatedLocalInput(TensorParallelLayer):
    """A replicated layer that computes on the local tensor of a replicated DTensor input (a LoRA ``lora_A`` beside a
    colwise base layer, whose input sequence parallelism gathers as a DTensor); its input's gradient is complete on
    every rank. A plain input passes through."""

    def transform_inputs_pre_forward(self, module: nn.Module, args: Any, kwargs: Any, mesh: DeviceMesh) -> Any:
        if args and isinstance(args[0], DTensor):
            args = (args[0].to_local(grad_placements=[Replicate()]), *args[1:])
        return args, kwargs


class Conv1DColwise(ColwiseParallel):
    """``colwise`` on a ``Conv1D``: its weight ``(in, out)`` shards on dim 1, its bias on dim 0; the forward runs on
    DTensors (``addmm`` of a replicated input and column shards gives this rank's output features)."""

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return False

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return TensorParallelLayer.install_forward(self, module, mesh)

    def shard_param(self, module: nn.Module, param: str, mesh: DeviceMesh) -> None:
        _shard_parameter(module, param, mesh, Shard(0) if param == "bias" else Shard(1))


class Conv1DRowwise(RowwiseParallel):
    """``rowwise`` on a ``Conv1D``: its weight ``(in, out)`` shards on dim 0, its bias stays replicated; ``addmm``
    of the input's feature shards and the weight's row shards is a partial sum that the output layout reduces, with
    the bias added once."""

    def should_use_local_tensors(self, module: nn.Module) -> bool:
        return False

    def install_forward(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return TensorParallelLayer.install_forward(self, module, mesh)

    def shard_param(self, module: nn.Module, param: str, mesh: DeviceMesh) -> None:
        _shard_parameter(module, param, mesh, Replicate() if param == "bias" else Shard(0))

    def transform_inputs_pre_forward(self, module: nn.Module, args: Any, kwargs: Any, mesh: DeviceMesh) -> Any:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layouts], run_check=False)
        if x.placements != (Shard(x.ndim - 1),):
            x = x.redistribute(placements=[Shard(x.ndim - 1)])
        return (x, *args[1:]), kwargs


def _shard_parameter(module: nn.Module, param: str, mesh: DeviceMesh, placement: Any) -> None:
    meta = module._parameters.get(param)
    if meta is not None:
        sharded = distribute_tensor(meta, mesh, [placement], src_data_rank=None)
        module._parameters[param] = nn.Parameter(sharded, requires_grad=meta.requires_grad)


#: Styles of ours, by the names plans use (``adapters.LOCAL_INPUT_STYLE``).
OUR_STYLES: dict[str, TensorParallelLayer] = {
    "replicated_with_grad_allreduce": REPLICATED_WITH_GRAD_ALLREDUCE_ONCE,
    "replicated_local_input": ReplicatedLocalInput(),
}
