"""Tensor parallelism (+ sequence parallelism) from the model's own TP plan.

Plans are transformers' plans: literal dicts from module / parameter names (with ``*`` for layer numbers) to
transformers' style names. Shared code never writes a per-architecture plan; a model without one gets a clear error,
and a sidecar can supply one (``ModelParallelizer._tp_plan``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .hf_plans import (
    SequenceParallelNorm,
    SequenceParallelRowwise,
    TensorParallelLayer,
    expand_plan,
    model_tp_plan,
    style_named,
)
from .model_structure import decoder_layers, retie_parameters, tied_parameter_names

__all__ = ["apply_tensor_parallel", "resolve_tp_plan", "validate_attention_heads"]

TPPlan = dict[str, str]
_KEY_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn")


def resolve_tp_plan(model: nn.Module, override: TPPlan | str | Callable[[nn.Module], TPPlan] | None = None) -> TPPlan:
    """The TP plan to apply: ``override`` (a dict, a callable of the model, or its ``"module:attr"`` import path),
    else the model's own (``_tp_plan`` + ``config.base_model_tp_plan``).

    Raises when the result is empty, naming the class and the ways to supply one.
    """
    if isinstance(override, str):
        module_name, _, attr = override.replace(":", ".").rpartition(".")
        override = getattr(importlib.import_module(module_name), attr)
    if callable(override):
        override = override(model)
    plan = dict(override) if override is not None else model_tp_plan(model)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (no `_tp_plan` on the class and no "
            "`base_model_tp_plan` on its config), so tp_size > 1 cannot shard it. Supply one, with transformers style "
            'names, e.g. {"model.layers.*.self_attn.q_proj": "colwise", ...}: pass `tp_plan=` to from_pretrained / '
            "from_config, set `_tp_plan` on a sidecar ModelParallelizer subclass "
            "(model_sidecars/<model>/parallelization.py), or pass `tp_shard_plan` to its `_apply`."
        )
    return plan


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
    config = getattr(model, "config", None)
    if attention is None or config is None:
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    for label, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(
                f"{attention}: {label}={count} is not divisible by tp_size={tp_size}, so its heads cannot be split "
                f"evenly over the TP ranks. Choose a tp_size that divides {count}."
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, sequence_parallel: bool) -> None:
    """Shard parameters and install the forward transforms of every plan entry on ``tp_mesh``.

    With ``sequence_parallel`` the decoder layers run on sequence shards (see :func:`_sequence_parallel_styles`).
    Tied parameters stay one ``Parameter``.
    """
    tied = tied_parameter_names(model)
    expanded = expand_plan(model, plan)
    styles = {name: style_named(style) for name, style in expanded.items()}
    if sequence_parallel:
        styles = _sequence_parallel_styles(model, expanded, styles, tp_mesh)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, style in styles.items():
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            style.validate_param(modules[module_name], param_name, tp_mesh, parameter_name=name)
            style.shard_param(modules[module_name], param_name, tp_mesh)
        else:
            style.install_forward(modules[name], tp_mesh)
    _check_tied_placements(model, tied)
    retie_parameters(model, tied)


def _check_tied_placements(model: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        placements = {name: getattr(model.get_parameter(name), "placements", (Replicate(),)) for name in names}
        if len(set(placements.values())) > 1:
            raise ValueError(
                f"Tied parameters {names} would be sharded differently by the TP plan ({placements}); give them "
                "the same placement in the plan or untie them (tie_word_embeddings=False)."
            )


# Styles a decoder layer may use under sequence parallelism, and their sequence-parallel form (None: unchanged).
_SEQUENCE_PARALLEL_FORMS: dict[str, Callable[[], TensorParallelLayer] | None] = {
    # Its block's input is all-gathered over the sequence before it (see _gather_block_input_hook).
    "colwise": None,
    "rowwise": SequenceParallelRowwise,
    # Per-head norms after a colwise projection see the whole sequence: unchanged.
    "replicated_with_grad_allreduce": None,
    "replicate": None,
}


def _sequence_parallel_styles(
    model: nn.Module, expanded: TPPlan, styles: dict[str, TensorParallelLayer], mesh: DeviceMesh
) -> dict[str, TensorParallelLayer]:
    """Convert the decoder layers' styles so activations between TP regions stay sharded over the sequence.

    The sequence is split when it enters the first decoder layer and gathered when it leaves the last, so embeddings,
    rotary positions, masks, the final norm and the head see the whole sequence as usual. Inside the layers colwise
    projections all-gather the sequence, rowwise projections reduce-scatter onto it, and the layers' own norms run on
    sequence shards with their gradients summed over TP.
    """
    layers = decoder_layers(model)
    layer_names = {module: name for name, module in model.named_modules()}
    prefixes = tuple(f"{layer_names[layer]}." for layer in layers)
    converted = dict(styles)
    for name, style_name in expanded.items():
        if not name.startswith(prefixes):
            continue
        if style_name not in _SEQUENCE_PARALLEL_FORMS:
            raise ValueError(
                f"Sequence parallelism cannot follow the TP style {style_name!r} of {name}: it supports "
                f"{sorted(_SEQUENCE_PARALLEL_FORMS)} inside decoder layers. Use sequence_parallel=False for this model."
            )
        form = _SEQUENCE_PARALLEL_FORMS[style_name]
        if form is not None:
            converted[name] = form()
    for layer in layers:
        for child_name, child in layer.named_children():
            full_name = f"{layer_names[layer]}.{child_name}"
            if any(key == full_name or key.startswith(full_name + ".") for key in expanded):
                child.register_forward_pre_hook(_gather_block_input_hook(mesh), with_kwargs=True)
                continue
            params = list(child.parameters())
            if not params:
                continue
            if any(p.ndim != 1 for p in params):
                # Neither sharded by the plan nor per-token (e.g. a MoE block whose experts EP owns): it runs on the
                # whole sequence on every TP rank, exactly as it does without SP.
                child.register_forward_pre_hook(_gather_block_input_hook(mesh, as_dtensor=False), with_kwargs=True)
                child.register_forward_hook(_rescatter_block_output_hook(mesh))
                continue
            converted[full_name] = SequenceParallelNorm()
    layers[0].register_forward_pre_hook(_scatter_sequence_hook(mesh), with_kwargs=True)
    layers[-1].register_forward_hook(_gather_sequence_hook(mesh))
    return converted


def _scatter_sequence_hook(mesh: DeviceMesh):
    def hook(module, args, kwargs):
        hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if hidden.shape[1] % mesh.size():
            raise ValueError(
                f"Sequence parallelism needs the sequence length ({hidden.shape[1]}) to be divisible by tp_size "
                f"({mesh.size()}); pad the batch to a multiple of {mesh.size()}."
            )
        local = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        local = local.redistribute(placements=[Shard(1)]).to_local()
        if args:
            return (local, *rest), kwargs
        return args, {**kwargs, "hidden_states": local}

    return hook


def _gather_block_input_hook(mesh: DeviceMesh, *, as_dtensor: bool = True):
    """All-gather a block's sequence-sharded input (as a replicated DTensor for TP projections, or a plain tensor)."""

    def hook(module, args, kwargs):

        def gather(local):
            full = DTensor.from_local(local, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
            return full if as_dtensor else full.to_local()

        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    return hook


def _rescatter_block_output_hook(mesh: DeviceMesh):
    """Keep this rank's sequence shard of a block output computed on the whole sequence (identical on every TP rank);
    its backward all-gathers the output gradient, so every rank back-propagates the whole sequence."""

    def split(full):
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (split(output[0]).to_local(), *output[1:])
        return split(output).to_local()

    return hook


def _gather_sequence_hook(mesh: DeviceMesh):
    def gather(local):
        return (
            DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
            .redistribute(placements=[Replicate()])
            .to_local()
        )

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (gather(output[0]), *output[1:])
        return gather(output)

    return hook
