"""Tensor parallelism (+ sequence parallelism) from a TP plan.

Plans are transformers' plans: literal dicts from module / parameter names (with ``*`` for layer numbers) to
transformers' style names. One plan applies, chosen by a stated precedence (:func:`choose_tp_plan`): the one a user
passes to ``from_pretrained(tp_plan=...)``, else the sidecar's, else the model's own, else one derived from the module
tree (:mod:`derived_tp_plan`). Shared code never writes a per-architecture plan; a model from which none can be
derived gets a clear error saying why.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from automodel._compat.torch import tree_map_only

from .adapters import LOCAL_INPUT_STYLE, adapter_placements
from .derived_tp_plan import DERIVED_SOURCE, derive_tp_plan
from .hf_plans import expand_plan, matchable_plan_keys, model_tp_plan
from .model_structure import (
    attention_head_counts,
    decoder_layers,
    encoder_tower_blocks,
    retie_parameters,
    tied_parameter_names,
)
from .partial_gradients import reduce_partial_gradients
from .pipeline_stages import whole_model
from .replica_check import check_replicated_gradients_once
from .tp_styles import (
    SequenceParallelNorm,
    SequenceParallelRowwise,
    TensorParallelLayer,
    for_module,
    install_module_style,
    owned_local,
    packed_fused_projections,
    places_own_parameters,
    replicate_on_mesh,
    style_named,
)

__all__ = [
    "TPPlanChoice",
    "apply_tensor_parallel",
    "choose_tp_plan",
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


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool,
    owned_elsewhere: list[str] = (),
    check_gradients: bool = False,
) -> None:
    """Shard parameters and install the forward transforms of every plan entry on ``tp_mesh``.

    With ``check_gradients`` (on for a derived plan) the first backward checks that every replicated parameter got
    the same gradient on every TP rank (:mod:`replica_check`).

    With ``sequence_parallel`` the decoder layers run on sequence shards (see :func:`_sequence_parallel_styles`).
    Parameters the plan does not shard become replicated DTensors on ``tp_mesh`` (:func:`tp_styles.replicate_on_mesh`),
    except inside the modules named in ``owned_elsewhere`` (the routed experts EP places next).
    Tied parameters stay one ``Parameter``.
    """
    tied = tied_parameter_names(model)
    expanded = expand_plan(model, adapter_placements(model, expand_plan(model, plan), sequence_parallel))
    # A pipeline stage holds parameter-free stand-ins for the modules other stages run (``lm_head`` before the last).
    stand_ins = {name for name, module in model.named_modules() if getattr(module, "absent_from_stage", False)}
    expanded = {name: style for name, style in expanded.items() if name not in stand_ins}
    styles = {name: style_named(style) for name, style in expanded.items()}
    if sequence_parallel:
        styles = _sequence_parallel_styles(model, expanded, styles, tp_mesh)
    modules = dict(model.named_modules())
    styles = {
        name: for_module(modules[name if name in modules else name.rpartition(".")[0]], style, name)
        for name, style in styles.items()
    }
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, style in styles.items():
        if name in parameters:
            module_name, _, param_name = name.rpartition(".")
            style.validate_param(modules[module_name], param_name, tp_mesh, parameter_name=name)
            style.shard_param(modules[module_name], param_name, tp_mesh)
    _check_tied_placements(model, tied)
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
    "packed_colwise": None,
    "rowwise": SequenceParallelRowwise,
    # Per-head norms after a colwise projection see the whole sequence: unchanged.
    "replicated_with_grad_allreduce": None,
    "replicate": None,
    # A LoRA lora_A beside a colwise base layer: it takes the gathered input, as the base layer does.
    LOCAL_INPUT_STYLE: None,
}
# The style of a routed-experts module under TP: its block runs on the whole sequence (see below).
_ROUTED_EXPERTS_STYLE = "moe_tp_experts"


def _sequence_parallel_styles(
    model: nn.Module, expanded: TPPlan, styles: dict[str, TensorParallelLayer], mesh: DeviceMesh
) -> dict[str, TensorParallelLayer]:
    """Convert the decoder layers' styles so activations between TP regions stay sharded over the sequence.

    The sequence is split when it enters the first decoder layer and gathered when it leaves the last, so embeddings,
    rotary positions, masks, the final norm and the head see the whole sequence as usual. Inside a layer each block
    (child module) takes one of three forms:

    - TP-sharded with sequence-parallel styles (attention, MLP): colwise projections all-gather the sequence, rowwise
      projections reduce-scatter onto it;
    - per-token with replicated 1-D parameters (norms): run on sequence shards, their gradients summed over TP;
    - everything else (routed experts, which TP shards as whole-expert slices or EP owns; mixers, convolutions and
      scans TP leaves replicated): run on the whole sequence exactly as without SP, every output laid out like the
      hidden states cut back to this rank's shard.

    A decoder layer's own parameters (used on sequence shards) get their gradients summed over TP as well. A style
    that has no sequence-parallel form in a sharded block is refused, naming the module.

    A model with an encoder tower (a vision-language model) takes SP on its language decoder's layers only, and its
    hidden states are whole between those layers: the sequence is split when it enters each layer and gathered when
    it leaves it, because such models may merge encoder features into the hidden states between layers by
    whole-sequence positions (Qwen3-VL's deepstack). The encoder's blocks, replicated over TP, run as without SP.
    """
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    layers = [layer for layer in decoder_layers(model) if id(layer) not in encoder]
    layer_names = {module: name for name, module in model.named_modules()}
    converted = dict(styles)
    whole_sequence: list[str] = []
    for layer in layers:
        if next(layer.parameters(recurse=False), None) is not None:
            converted[layer_names[layer]] = style_named("replicated_with_grad_allreduce")
        for child_name, child in layer.named_children():
            full_name = f"{layer_names[layer]}.{child_name}"
            entries = {
                key: style for key, style in expanded.items() if key == full_name or key.startswith(f"{full_name}.")
            }
            if entries and _ROUTED_EXPERTS_STYLE not in entries.values():
                _convert_sharded_block(entries, converted)
                child.register_forward_pre_hook(_gather_block_input_hook(mesh), with_kwargs=True)
            elif entries or any(param.ndim != 1 for param in child.parameters()):
                whole_sequence.append(full_name)
                _run_on_whole_sequence(child, mesh)
            elif next(child.parameters(), None) is not None:
                converted[full_name] = SequenceParallelNorm()
    if whole_sequence:
        logger.debug("Sequence parallelism: blocks run on the whole sequence: %s", whole_sequence)
    for first, last in [(layer, layer) for layer in layers] if encoder else [(layers[0], layers[-1])]:
        first.register_forward_pre_hook(_scatter_sequence_hook(mesh), with_kwargs=True)
        last.register_forward_hook(_gather_sequence_hook(mesh))
    return converted


def _convert_sharded_block(entries: TPPlan, converted: dict[str, TensorParallelLayer]) -> None:
    for name, style_name in entries.items():
        if style_name not in _SEQUENCE_PARALLEL_FORMS:
            raise ValueError(
                f"Sequence parallelism cannot follow the TP style {style_name!r} of {name}: it supports "
                f"{sorted(_SEQUENCE_PARALLEL_FORMS)} inside decoder layers (and whole routed-experts blocks). Use "
                "sequence_parallel=False for this model, or a TP plan without that style."
            )
        form = _SEQUENCE_PARALLEL_FORMS[style_name]
        if form is not None:
            converted[name] = form()


def _run_on_whole_sequence(block: nn.Module, mesh: DeviceMesh) -> None:
    """Gather ``block``'s sequence-sharded input and cut its outputs back to this rank's shard: it computes exactly
    as without SP (identically on every TP rank), and its backward all-gathers the output gradients, so every rank
    back-propagates the whole sequence."""
    seen: dict[str, tuple[int, int]] = {}
    block.register_forward_pre_hook(_gather_block_input_hook(mesh, as_dtensor=False, seen=seen), with_kwargs=True)
    block.register_forward_hook(_rescatter_block_output_hook(mesh, seen))


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


def _gather_block_input_hook(mesh: DeviceMesh, *, as_dtensor: bool = True, seen: dict | None = None):
    """All-gather a block's sequence-sharded input (as a replicated DTensor for TP projections, or a plain tensor);
    ``seen`` records the gathered ``(batch, sequence)`` sizes for the output hook."""

    def hook(module, args, kwargs):

        def gather(local):
            full = DTensor.from_local(local, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
            if seen is not None:
                seen["shape"] = tuple(full.shape[:2])
            return full if as_dtensor else full.to_local()

        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    return hook


def _rescatter_block_output_hook(mesh: DeviceMesh, seen: dict[str, tuple[int, int]]):
    """Keep this rank's sequence shard of every output laid out like the block's gathered input (``[batch,
    sequence, ...]``), computed on the whole sequence (identical on every TP rank); its backward all-gathers the
    output gradient."""

    def split(full: torch.Tensor) -> torch.Tensor:
        if full.ndim < 2 or tuple(full.shape[:2]) != seen["shape"]:
            return full
        shard = DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        return owned_local(shard.to_local())

    def hook(module, args, output):
        return tree_map_only(torch.Tensor, split, output)

    return hook


def _gather_sequence_hook(mesh: DeviceMesh):
    def gather(local):
        whole = DTensor.from_local(local, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()])
        return owned_local(whole.to_local())

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (gather(output[0]), *output[1:])
        return gather(output)

    return hook
