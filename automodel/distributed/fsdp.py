"""FSDP2 unit selection and the ``fully_shard`` helpers a sidecar may reuse."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from automodel._compat.torch import fsdp_param_groups

from .hf_plans import model_fsdp_plan, module_style
from .model_structure import decoder_layers, input_embeddings, output_embeddings, tied_parameter_names

__all__ = [
    "default_fsdp_units",
    "fsdp_mesh",
    "fsdp_shard_dim",
    "fully_shard_by_dtype",
    "fully_shard_default",
    "reshard_after_gradless_forward",
    "route_encoders_through_root",
    "shard_default_units",
    "unshard_for_outside_calls",
]

ShardFn = Callable[..., nn.Module]


def fully_shard_default(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` with ``None`` keyword arguments left at torch's defaults, and each
    parameter sharded on the dim :func:`fsdp_shard_dim` chooses (unless the caller passes a ``shard_placement_fn``)."""
    options = {key: value for key, value in kwargs.items() if value is not None}
    if "shard_placement_fn" not in options and "mesh" in options:
        options["shard_placement_fn"] = _placement_over(options["mesh"])
    return fully_shard(module, **options)


def fsdp_shard_dim(shape: tuple[int, ...], group_size: int) -> int:
    """The dim FSDP2 shards a (TP- or EP-local) tensor of ``shape`` on over ``group_size`` ranks.

    Dim 0, FSDP2's default, which pads it to a multiple of the group: unless that padding would add more than 1/16 of
    the tensor and a later dim divides evenly (FSDP2 shards only dim 0 unevenly). Then the first such dim: a rank's
    part is whole rows of the dims after it, contiguous in the checkpoint file. This is what keeps experts shrinking
    past one per rank: a rank group of 16 over 2 local experts of shape (2, 3072, 4096) would otherwise pad dim 0 to
    16 whole experts, one per rank, 8x the rank's share (torchtitan shards experts on dim 1 for the same reason).
    """
    if not shape or group_size <= 1:
        return 0
    rows = shape[0]
    padding = -(-rows // group_size) * group_size - rows
    if padding * 16 <= rows:
        return 0
    return next((dim for dim in range(1, len(shape)) if shape[dim] % group_size == 0), 0)


def _placement_over(mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard | None]:
    """``fully_shard``'s ``shard_placement_fn`` for ``mesh`` (1-D, or HSDP's (replicate, shard)): ``None`` (dim 0,
    FSDP2's default) or ``Shard(d)`` by :func:`fsdp_shard_dim`."""
    group_size = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        dim = fsdp_shard_dim(tuple(local.shape), group_size)
        return Shard(dim) if dim else None

    return placement


def fsdp_mesh(device_mesh: DeviceMesh, dp_replicate_mesh_name: str, dp_shard_cp_mesh_name: str) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard_cp``, or the 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP.

    The flattened ``dp_shard_cp`` axis is used, never the 2-D ``(dp_shard, cp)`` slice, which FSDP2 would silently
    read as HSDP.
    """
    with warnings.catch_warnings():
        # `_apply` receives the root mesh and axis names (the documented hook signature), so the flattened axis is
        # sliced from the root; torch plans to deprecate that in favour of keeping the flattened mesh object.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        if device_mesh[dp_replicate_mesh_name].size() > 1:
            return device_mesh[(dp_replicate_mesh_name, dp_shard_cp_mesh_name)]
        return device_mesh[dp_shard_cp_mesh_name]


def default_fsdp_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The modules sharded as their own FSDP units before the root, innermost first, each with whether it keeps its
    full weight after forward.

    Units: decoder layers (``_no_split_modules``), the input embeddings, the output head and the modules of the
    model's transformers FSDP plan (whose ``"keep_full_weight"`` entries skip resharding after forward) — except
    modules holding a tied parameter, which stays in the root unit as one parameter, and modules holding none.
    """
    names = {module: name for name, module in model.named_modules()}
    tied = {name for group in tied_parameter_names(model) for name in group}
    plan = model_fsdp_plan(model)

    def holds_tied(module: nn.Module) -> bool:
        prefix = f"{names[module]}." if names[module] else ""
        return any(f"{prefix}{name}" in tied for name, _ in module.named_parameters(remove_duplicate=False))

    planned = [module for module, name in names.items() if name and module_style(name, plan) is not None]
    candidates = [*decoder_layers(model), input_embeddings(model), output_embeddings(model), *planned]
    units = [m for m in dict.fromkeys(candidates) if m is not None and m is not model and m in names]
    # Not a unit: a module holding a tied parameter, or none at all (a pipeline stage's stand-ins for other stages'
    # layers, embedding or head: an FSDP unit without parameters would only add hooks).
    units = [m for m in units if not holds_tied(m) and next(m.parameters(), None) is not None]
    units.sort(key=lambda module: -names[module].count("."))
    return [(module, module_style(names[module], plan) == "keep_full_weight") for module in units]


def shard_default_units(
    model: nn.Module,
    shard: Callable[..., nn.Module],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | None,
    **options,
) -> nn.Module:
    """Shard the default FSDP units (``default_fsdp_units``) with the primitive ``shard``, then the root.

    ``reshard_after_forward``: ``True`` reshards every unit after its forward (ZeRO-3), ``False`` none (ZeRO-2: the
    whole model stays unsharded from forward to backward), ``None`` the default policy: every unit but the last
    decoder layer and the output head (:func:`_kept_after_forward`). The root is never resharded after forward.

    A sidecar that only changes how each unit is sharded (e.g. dtype-uniform groups) passes its own primitive here
    and keeps the shared unit boundaries.
    """
    units = default_fsdp_units(model)
    kept = _kept_after_forward(model, [unit for unit, _ in units]) if reshard_after_forward is None else set()
    for unit, keep_full_weight in units:
        reshard = not (keep_full_weight or unit in kept or reshard_after_forward is False)
        shard(unit, mesh=mesh, reshard_after_forward=reshard, **options)
    # The root's parameters (tied embeddings, final norm) are needed again right after forward for backward.
    return shard(model, mesh=mesh, reshard_after_forward=False, **options)


def _kept_after_forward(model: nn.Module, units: list[nn.Module]) -> set[nn.Module]:
    """The units the default policy (``reshard_after_forward=None``, torchtitan's) keeps unsharded after forward:
    the last decoder layer and the output head, whose backward starts right after the forward ends, so resharding
    them would only all-gather them again at once. Costs their unsharded size for the forward-to-backward span."""
    layers = decoder_layers(model)
    return {module for module in (layers[-1] if layers else None, output_embeddings(model)) if module in units}


def prefetch_decoder_layers(model: nn.Module) -> int:
    """Explicit prefetch between consecutive decoder layers that are FSDP units: each layer's forward issues the
    next layer's all-gather before it computes, and each layer's backward the previous one's (``FSDPModule``'s
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, as torchtitan sets them), so the
    transfer runs while the layer computes. Returns the number of layers set."""
    layers = [layer for layer in decoder_layers(model) if isinstance(layer, FSDPModule)]
    for index, layer in enumerate(layers):
        if index + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[index + 1]])
        if index > 0:
            layer.set_modules_to_backward_prefetch([layers[index - 1]])
    return len(layers) if len(layers) > 1 else 0


def fully_shard_by_dtype(module: nn.Module, shard: ShardFn = fully_shard_default, **kwargs: Any) -> nn.Module:
    """Shard ``module`` so that every FSDP unit holds parameters of one dtype.

    FSDP2 refuses a unit mixing dtypes (e.g. fp32 ``A_log`` kept beside bf16 weights). The submodules that directly
    own parameters of a minority dtype become units of their own first, then ``module`` takes the majority dtype.
    ``shard`` is the primitive (a sidecar passes its ``self._fully_shard_module``).
    """
    owners = _direct_param_owners(module)
    counts: dict[torch.dtype, int] = {}
    for _, params in owners:
        for param in params:
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    if len(counts) > 1:
        majority = max(counts, key=counts.__getitem__)
        for owner, params in owners:
            dtypes = {param.dtype for param in params}
            if dtypes == {majority}:
                continue
            if len(dtypes) > 1 or owner is module:
                names = [name for name, _ in owner.named_parameters(recurse=False)]
                raise ValueError(
                    f"{type(owner).__name__} holds parameters of several dtypes ({sorted(map(str, dtypes))}: {names}) "
                    "directly, so no FSDP unit can be dtype-uniform. Move them into separate submodules."
                )
            shard(owner, **kwargs)
    return shard(module, **kwargs)


def _direct_param_owners(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Modules under ``module`` (not already FSDP units) with the parameters they own directly."""
    owners = []
    skip: set[int] = set()
    for sub in module.modules():
        if sub is not module and isinstance(sub, FSDPModule):
            skip.update(id(inner) for inner in sub.modules())
        if id(sub) in skip:
            continue
        params = list(sub.parameters(recurse=False))
        if params:
            owners.append((sub, params))
    return owners


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of ``model`` (a no-op for units that are sharded, and for a model without FSDP).

    A forward without gradients (an evaluation, a check before training) leaves the units that do not reshard after
    forward (the root, ``keep_full_weight`` units) unsharded, as no backward follows to reshard them; the next
    training step would then run on those parameters instead of FSDP's gather of the shards for that step, and its
    gradients for them would differ from a step that started resharded. Called after such a forward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshard_after_gradless_forward(model: nn.Module) -> bool:
    """Make every forward of ``model`` that no backward can follow reshard all its FSDP2 units at its end.

    The units that do not reshard after forward (the root, torchtitan's kept last layer and head,
    ``keep_full_weight`` units) wait for their backward to reshard them. After a forward under ``torch.no_grad()``
    or ``inference_mode`` (an evaluation, a check, ``generate``), or one whose outputs need no gradient, no backward
    comes: they would stay unsharded, holding their full size, ``named_parameters()`` would return their unsharded
    tensors instead of the shards, and the next step would start from them instead of a fresh gather. FSDP2 has no
    such rule of its own, so a forward hook (run after FSDP2's own post-forward) reshards every unit then. Returns
    whether the hook was installed (``model`` holds FSDP2 units)."""
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return False
    model.register_forward_hook(_reshard_unless_backward_follows)
    return True


def _reshard_unless_backward_follows(model: nn.Module, args: Any, output: Any) -> None:
    if not (torch.is_grad_enabled() and _needs_gradient(output)):
        reshard_all(model)


def _needs_gradient(output: Any) -> bool:
    """Whether a tensor in ``output`` (a tensor, or tuples, lists and dicts of them: a ``ModelOutput`` is a dict)
    requires a gradient."""
    if isinstance(output, torch.Tensor):
        return output.requires_grad
    if isinstance(output, dict):
        output = list(output.values())
    return isinstance(output, tuple | list) and any(_needs_gradient(item) for item in output)


def unshard_for_outside_calls(model: nn.Module) -> int:
    """Let the model call a submodule of an FSDP unit from outside that unit's forward; return the number of guards.

    Some models reach into a block from outside it: DiT's output head runs ``transformer_blocks[0].norm1.emb`` after
    the block loop, when block 0's unit has been resharded, and its parameters are shards (FSDP2 fails with "mixed
    torch.Tensor and DTensor"). Every module owning parameters of a (non-root) unit gets a forward pre-hook that
    unshards the unit when it finds it sharded, which happens only on such an outside call: inside the unit's own
    forward (or its backward recomputation) the unit is unsharded already. The unit then stays unsharded until its
    backward, which reshards it after reducing the gradients of both uses.
    """
    guards = 0
    for unit in model.modules():
        if unit is model or not isinstance(unit, FSDPModule):
            continue
        groups = fsdp_param_groups(unit)
        for module, _ in _direct_param_owners(unit):
            if module is not unit:
                module.register_forward_pre_hook(_unshard_if_sharded(unit, groups))
                guards += 1
    return guards


def _unshard_if_sharded(unit: FSDPModule, groups: list) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        if not all(group.is_unsharded for group in groups):
            unit.unshard()

    return hook


# transformers' multimodal encoders, which ``generate`` calls on ``base_model`` before the first forward.
_ENCODER_METHODS = ("get_image_features", "get_video_features", "get_audio_features")


def route_encoders_through_root(model: nn.Module) -> int:
    """Let ``generate`` run a multimodal model's encoders on FSDP2; return how many were routed.

    transformers' ``generate`` encodes the images (``base_model.get_image_features``, likewise video and audio)
    before the first forward, so outside the root unit's forward: the root's own parameters (a vision tower's
    embeddings, the projector) are shards then, and FSDP2 has not even initialised. Each such method, when called
    outside the root's forward, runs as a forward method of the root (torch's ``register_fsdp_forward_method``:
    the root's pre-forward initialises FSDP2 and gathers its parameters); inside the root's forward it runs as it
    is. The root's unsharded parameters are resharded after the generating forward (``reshard_after_gradless_forward``).
    """
    base = getattr(model, "base_model", None)
    if not isinstance(model, FSDPModule) or base is None:
        return 0
    depth = [0]  # > 0 while the root's forward runs

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    routed = 0
    for name in _ENCODER_METHODS:
        method = getattr(base, name, None)
        if not callable(method):
            continue
        through_root = f"_automodel_root_{name}"
        setattr(model, through_root, method)
        register_fsdp_forward_method(model, through_root)
        setattr(base, name, _routed(method, getattr(model, through_root), depth))
        routed += 1
    if routed:
        model.register_forward_pre_hook(enter)
        model.register_forward_hook(leave, always_call=True)
    return routed


def _routed(method: Callable[..., Any], through_root: Callable[..., Any], depth: list[int]) -> Callable[..., Any]:
    @functools.wraps(method)  # generate() picks the encoder's keywords from its signature
    def encoder(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs) if depth[0] else through_root(*args, **kwargs)

    return encoder
