"""Split a causal LM built on meta into pipeline stages, keeping transformers' forward and parameter names.

Each stage is a copy of the whole model (on meta: no memory) in which what other stages run is replaced by
parameter-free stand-ins: the decoder layers of other stages, the input modules (embeddings) on every stage but the
first, the output modules (final norm, head) on every stage but the last. A stage therefore runs the model's own
``forward``: masks, rotary positions and whatever else the model computes before its layers are computed on every
stage, from the same inputs, exactly as without PP; the stage's first layer then takes the activation the previous
stage sent instead of what arrived (:class:`StageForward`), and a stage that is not the last hands on its last
layer's output. Parameter and buffer names stay transformers' (``model.layers.5.mlp.up_proj.weight`` on the stage
holding layer 5), so checkpoints load and save with no renaming.

Which modules are inputs and outputs comes from the order in which one forward on meta calls them
(:func:`pipeline_roles`), not from names: a module holding parameters that runs before the first decoder layer is an
input, one that runs after the last is an output. A model with parameters used between its decoder layers (a block
shared by several layers), or whose layers do not run once each in order, is refused, naming the module.

Layers are balanced over the stages (:func:`stage_layer_counts`): each stage gets at least one, and the first and
the last stage count their input and output modules as one layer each.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel._compat.transformers import ForCausalLMLoss

from .meta_trace import FakeScalars, eager_experts, meta_forward, meta_twin
from .model_structure import decoder_layers, encoder_tower_blocks
from .pipeline_checks import check_stage_runs

__all__ = [
    "PIPELINE_STAGE_ATTRIBUTE",
    "PipelineRoles",
    "StageForward",
    "build_stage",
    "pipeline_roles",
    "stage_forward",
    "stage_layer_counts",
    "whole_model",
]

#: Set on a stage module (in its ``__dict__``, not as a submodule): the whole model (on meta) it was cut from.
PIPELINE_STAGE_ATTRIBUTE = "_automodel_pipeline_stage"
# The stage's StageForward: the parallelizer may wrap ``stage.forward`` (TP hands back owned outputs), so the pipeline
# reaches the object it set through here, not through ``stage.forward``.
_STAGE_FORWARD_ATTRIBUTE = "_automodel_stage_forward"

_TRACE_LENGTH = 8


@dataclass(frozen=True)
class PipelineRoles:
    """Where a model's parts go: its decoder layers (names, in order, in one ``ModuleList``), the modules with
    parameters that run before them (inputs, first stage) and after them (outputs, last stage), the modules the
    causal forward never runs (first stage), and whether a decoder layer returns a tuple (``(hidden_states, ...)``)
    or the hidden states alone; from the meta trace (one sequence of ``_TRACE_LENGTH`` tokens), the shape and dtype of
    the activation stages hand on and the shape of the input embeddings' output."""

    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    unused: tuple[str, ...]
    layer_output_length: int | None  # None: a tensor; n: a tuple of n
    activation_shape: tuple[int, ...] = ()
    activation_dtype: torch.dtype = torch.float32
    embedding_shape: tuple[int, ...] | None = None  # None: no input embeddings found in the trace

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def pipeline_roles(model: nn.Module) -> PipelineRoles:
    """The roles of ``model``'s modules (built on meta or not; a meta twin is run, never the model). Raises
    ``ValueError`` naming the module for a model that pipeline stages cannot split."""
    name = type(model).__name__
    _check_loss(model)
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    blocks = [block for block in decoder_layers(model) if id(block) not in encoder]
    module_names = {module: module_name for module_name, module in model.named_modules()}
    layers = [module_names[block] for block in blocks]
    parents = {layer.rpartition(".")[0] for layer in layers}
    if len(parents) != 1 or not isinstance(model.get_submodule(next(iter(parents))), nn.ModuleList):
        raise ValueError(
            f"{name} cannot be split into pipeline stages: its decoder layers are not the members of one ModuleList "
            f"({sorted(parents)[:4]}). Use pp_size=1."
        )
    twin = meta_twin(model)
    eager_experts(twin)
    calls: list[tuple[str, str]] = []  # ("enter" | "leave", module name), in call order
    outputs: dict[str, Any] = {}
    handles = []
    for module_name, module in twin.named_modules():
        if module_name:
            handles.append(module.register_forward_pre_hook(_record(calls, "enter", module_name)))
            handles.append(module.register_forward_hook(_record(calls, "leave", module_name, outputs)))
    try:
        with FakeScalars():
            meta_forward(twin, _TRACE_LENGTH)
    except Exception as error:  # noqa: BLE001 - any failure of the meta forward makes the split impossible
        raise ValueError(
            f"{name} cannot be split into pipeline stages: its forward does not run on the meta device "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}). Use pp_size=1."
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    entered = [module_name for kind, module_name in calls if kind == "enter"]
    layer_calls = [module_name for module_name in entered if module_name in set(layers)]
    if layer_calls != layers:
        raise ValueError(
            f"{name} cannot be split into pipeline stages: its decoder layers do not run once each in order "
            f"(ran {layer_calls[:6]}...). Use pp_size=1."
        )
    first = calls.index(("enter", layers[0]))
    last = calls.index(("leave", layers[-1]))
    inside = tuple(f"{layer}." for layer in layers)
    span: dict[str, tuple[int, int]] = {}  # module -> (first, last) position in the call order
    for position, (_, called) in enumerate(calls):
        span[called] = (span.get(called, (position, position))[0], position)
    inputs, outs, unused = [], [], []
    for module_name, module in model.named_modules():
        if not module_name or module_name in layers or module_name.startswith(inside):
            continue
        if next(module.parameters(recurse=False), None) is None:
            continue
        if module_name not in span:
            unused.append(module_name)
        elif span[module_name][1] < first:
            inputs.append(module_name)
        elif span[module_name][0] > last:
            outs.append(module_name)
        else:
            raise ValueError(
                f"{name} cannot be split into pipeline stages: {module_name} ({type(module).__name__}) holds "
                "parameters and runs between or around its decoder layers, so no one stage can own it. Use pp_size=1."
            )
    sample = outputs[layers[0]]
    length = len(sample) if isinstance(sample, tuple) else None
    if length is None and not isinstance(sample, torch.Tensor):
        raise ValueError(
            f"{name} cannot be split into pipeline stages: its decoder layer {layers[0]} returns a "
            f"{type(sample).__name__}, not the hidden states or a tuple starting with them. Use pp_size=1."
        )
    activation = sample[0] if isinstance(sample, tuple) else sample
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedded = outputs.get(module_names.get(embeddings, ""))
    return PipelineRoles(
        tuple(layers),
        _outermost(inputs),
        _outermost(outs),
        _outermost(unused),
        length,
        tuple(activation.shape),
        activation.dtype,
        tuple(embedded.shape) if isinstance(embedded, torch.Tensor) else None,
    )


def _check_loss(model: nn.Module) -> None:
    """``train_step`` computes transformers' causal-LM loss (labels shifted by one) per microbatch: refuse a model
    whose own ``forward`` computes another one, naming why (plain transformers' loss is the oracle)."""
    name = type(model).__name__
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    # transformers' `loss_function` property without its warning: an explicit one, else by `loss_type` (None: causal).
    loss = model.__dict__.get("_loss_function")
    causal = loss is ForCausalLMLoss or (loss is None and getattr(model, "loss_type", None) in (None, "ForCausalLM"))
    if "self.loss_function(" not in source or not causal:
        raise ValueError(
            f"{name} cannot be split into pipeline stages: its forward does not compute transformers' causal-LM loss "
            "(`self.loss_function`, labels shifted by one; it computes its own, e.g. on labels it expects already "
            "shifted), which a pipelined train_step reproduces per microbatch. Use pp_size=1."
        )
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{name} cannot be split into pipeline stages with output_router_logits=True: its loss adds the routers' "
            "auxiliary loss, which a pipelined train_step does not compute yet. Set output_router_logits=False (pass "
            "it to from_pretrained), or use pp_size=1."
        )


def _record(calls: list, kind: str, module_name: str, outputs: dict | None = None):
    if kind == "enter":

        def enter(module, args):
            calls.append((kind, module_name))

        return enter

    def leave(module, args, output):
        calls.append((kind, module_name))
        outputs.setdefault(module_name, output)

    return leave


def _outermost(names: list[str]) -> tuple[str, ...]:
    """The names not inside another of them (a module and its submodules move together)."""
    return tuple(name for name in names if not any(name.startswith(f"{other}.") for other in names if other != name))


def stage_layer_counts(num_layers: int, num_stages: int, *, input_weight: float = 1.0, output_weight: float = 1.0):
    """Decoder layers per stage: contiguous, at least one each, with the largest stage cost as small as it can be (a
    layer costs 1; the first stage adds ``input_weight``, the last ``output_weight``); of those splits, the one with
    the most even costs, then the most even layer counts. Raises ``ValueError`` when there are fewer layers than
    stages."""
    if num_layers < num_stages:
        raise ValueError(
            f"The model has {num_layers} decoder layers and the pipeline {num_stages} stages (pp_size x "
            "pp_virtual_stages): every stage needs at least one layer. Use fewer stages."
        )

    def cost(stage: int, layers: int) -> float:
        extra = (input_weight if stage == 0 else 0.0) + (output_weight if stage == num_stages - 1 else 0.0)
        return layers + extra

    def splits(stage: int, layers: int) -> range:  # the layer counts stage `stage` may take of `layers` left
        return range(1, layers - (num_stages - 1 - stage) + 1)

    # The smallest possible largest cost: the largest layer count of an even split, checked upwards.
    candidates = sorted({cost(stage, n) for stage in range(num_stages) for n in range(1, num_layers + 1)})
    limit = next(bound for bound in candidates if _fits(num_layers, num_stages, cost, bound))
    # Under that limit, the split with the smallest (sum of squared costs, sum of squared layer counts): additive, so
    # one pass over (stage, layers used) finds it exactly.
    best: dict[tuple[int, int], tuple[tuple[float, int], list[int]]] = {(0, 0): ((0.0, 0), [])}
    for stage in range(num_stages):
        for (_, used), (score, counts) in [item for item in best.items() if item[0][0] == stage]:
            for n in splits(stage, num_layers - used):
                if cost(stage, n) > limit:
                    continue
                key = (stage + 1, used + n)
                candidate = ((score[0] + cost(stage, n) ** 2, score[1] + n * n), [*counts, n])
                if key not in best or candidate[0] < best[key][0]:
                    best[key] = candidate
    return best[(num_stages, num_layers)][1]


def _fits(num_layers: int, num_stages: int, cost, bound: float) -> bool:
    """Whether ``num_layers`` split into ``num_stages`` contiguous stages of at least one layer, each costing at most
    ``bound``."""
    reachable = {0}
    for stage in range(num_stages):
        reachable = {used + n for used in reachable for n in range(1, num_layers - used + 1) if cost(stage, n) <= bound}
    return num_layers in reachable


class _SkippedLayer(nn.Module):
    """A decoder layer another stage runs: hands its hidden states on (in the layer's own output structure), and
    keeps the layer's plain attributes (``block_type``, ``attention_type``, ``layer_idx`` ...), which the model's
    forward may read to choose each layer's mask."""

    absent_from_stage = True  # a TP plan's rule naming it is skipped

    def __init__(self, output_length: int | None, layer: nn.Module | None = None) -> None:
        super().__init__()
        self.output_length = output_length
        for name, value in vars(layer or nn.Module()).items():
            if not name.startswith("_") and name != "training" and _is_plain(value):
                setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.output_length is None:
            return hidden_states
        return (hidden_states,) + (None,) * (self.output_length - 1)


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_is_plain(item) for item in value)
    return value is None or isinstance(value, str | int | float | bool)


class _AbsentEmbedding(nn.Module):
    """An embedding another stage holds: zeros of its output shape for token ids, else a zero scalar (a position
    embedding called with something else broadcasts into its sum); the stage's first layer takes the activation the
    previous stage sent instead."""

    absent_from_stage = True  # a TP plan's rule naming it is skipped

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.dtype = embedding_dim, dtype

    def forward(self, input_ids: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(input_ids, torch.Tensor) and not input_ids.is_floating_point():
            return input_ids.new_zeros((*input_ids.shape, self.embedding_dim), dtype=self.dtype)
        device = input_ids.device if isinstance(input_ids, torch.Tensor) else None
        return torch.zeros((), dtype=self.dtype, device=device)


class _AbsentModule(nn.Module):
    """A module another stage holds: passes its first input through."""

    absent_from_stage = True  # a TP plan's rule naming it is skipped

    def forward(self, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        return value


def _stand_in(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return _AbsentEmbedding(module.embedding_dim, module.weight.dtype)
    return _AbsentModule()


def build_stage(model: nn.Module, roles: PipelineRoles, layers: range, *, first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` (on meta) that holds only decoder ``layers`` (indices into ``roles.layers``), the inputs
    when ``first`` and the outputs when ``last``; its ``forward`` is :class:`StageForward`."""
    stage = copy.deepcopy(model)
    replace: dict[str, nn.Module] = {}
    for index, layer in enumerate(roles.layers):
        if index not in layers:
            replace[layer] = _SkippedLayer(roles.layer_output_length, stage.get_submodule(layer))
    if not first:
        replace |= {name: _stand_in(stage.get_submodule(name)) for name in (*roles.inputs, *roles.unused)}
    if not last:
        replace |= {name: _AbsentModule() for name in roles.outputs}
    for name, stand_in in replace.items():
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name)
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = stand_in
        else:
            setattr(parent, child, stand_in)
    own = [stage.get_submodule(roles.layers[index]) for index in layers]
    embeds = _stage_inputs_embeds(roles)
    stage.forward = StageForward(stage, own[0], own[-1], first=first, last=last, inputs_embeds=embeds)
    stage.__dict__[_STAGE_FORWARD_ATTRIBUTE] = stage.forward
    stage.__dict__[PIPELINE_STAGE_ATTRIBUTE] = model
    check_stage_runs(stage, model, _trace_inputs(roles, first=first), layers)
    return stage


def _stage_inputs_embeds(roles: PipelineRoles) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a later stage passes its model's forward as ``inputs_embeds`` (for their batch and sequence shape: the
    first own layer takes the received activation itself): a detached copy of the activation where it has the input
    embeddings' shape (CTRL scales its ``inputs_embeds`` in place, which the received activation, a leaf that requires
    grad, does not allow), else zeros of the embeddings' shape (RemBERT's narrower embeddings, DeepSeek-V4's
    activation of several streams, which its forward builds from the embeddings)."""
    embedded, activation = roles.embedding_shape, roles.activation_shape
    if embedded is None or embedded == activation or len(embedded) < 2 or embedded[:2] != activation[:2]:
        return _detached_copy
    trailing = embedded[2:]
    return lambda received: received.new_zeros((*received.shape[:2], *trailing))


def _detached_copy(received: torch.Tensor) -> torch.Tensor:
    return received.detach().clone()


def _trace_inputs(roles: PipelineRoles, *, first: bool) -> torch.Tensor:
    """What a stage receives in the meta check: token ids for the first stage, else the activation of the trace."""
    if first:
        return torch.zeros(1, _TRACE_LENGTH, dtype=torch.long, device="meta")
    return torch.zeros(roles.activation_shape, dtype=roles.activation_dtype, device="meta")


def stage_forward(stage: nn.Module) -> StageForward:
    """The :class:`StageForward` :func:`build_stage` gave ``stage`` (whatever wraps ``stage.forward`` since)."""
    return stage.__dict__[_STAGE_FORWARD_ATTRIBUTE]


def whole_model(module: nn.Module) -> nn.Module:
    """The whole model a pipeline stage was cut from (on meta), else ``module`` itself. What is decided from the
    module tree (a derived TP plan) is decided on it, so that every stage applies the same decision: a stage alone
    does not see that its head is tied to another stage's embedding."""
    return module.__dict__.get(PIPELINE_STAGE_ATTRIBUTE, module)


class StageForward:
    """The ``forward`` of a stage: the model's own forward (``type(model).forward``) on ``input_ids`` (first stage)
    or on the received activation as ``inputs_embeds`` (so that masks and positions get its shape), with the first
    own layer's hidden states replaced by the received activation; it returns the logits (last stage) or the last
    own layer's output."""

    def __init__(
        self,
        model: nn.Module,
        first_layer: nn.Module,
        last_layer: nn.Module,
        *,
        first: bool,
        last: bool,
        inputs_embeds: Callable[[torch.Tensor], torch.Tensor] = _detached_copy,
    ):
        self.model_forward = type(model).forward
        self.inputs_embeds = inputs_embeds
        self.model = model  # the stage itself: a reference cycle the garbage collector handles
        self.first, self.last = first, last
        self.received: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None
        # Last stage: return the output head's input instead of the logits (a loss that runs the head itself, e.g.
        # the fused linear cross-entropy); the head then computes one position only, a stand-in the forward discards.
        self.return_head_input = False
        self.last_layer = last_layer
        if not first:
            # First of the layer's pre-hooks: what the parallelizer adds (SP's scatter) sees the received activation.
            first_layer.register_forward_pre_hook(self._take_received, with_kwargs=True, prepend=True)

    def __call__(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if inputs is None:
            # Called as the model is (``stage(input_ids=...)``: a meta trace deriving the stage's TP plan): the
            # model's own forward over the stage's parts, with its own output.
            return self.model_forward(self.model, **kwargs)
        kwargs = {"use_cache": False, **kwargs}
        if self.first:
            kwargs["input_ids"] = inputs
        else:
            self.received = inputs
            kwargs["inputs_embeds"] = self.inputs_embeds(inputs)
        captured: list[torch.Tensor] = []
        handle = None
        if self.last and self.return_head_input:
            handle = self.model.get_output_embeddings().register_forward_pre_hook(
                functools.partial(_capture_input, captured), prepend=True
            )
        elif not self.last:
            # Registered per call, so it runs after every hook the parallelizer installed on the layer: what is sent
            # is what the layer hands on (SP's gather of the sequence shards included), not its raw output.
            handle = self.last_layer.register_forward_hook(self._keep_output)
        try:
            output = self.model_forward(self.model, **kwargs)
        finally:
            self.received = None
            if handle is not None:
                handle.remove()
        if self.last and self.return_head_input:
            if len(captured) != 1:
                raise RuntimeError(f"The output head ran {len(captured)} times in one forward of the last stage.")
            return captured[0]
        if self.last:
            return output.logits
        sent, self.sent = self.sent, None
        return sent

    def _take_received(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.received is None:
            return None
        if args:
            return (self.received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.received}

    def _keep_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.sent = output[0] if isinstance(output, tuple) else output


def _capture_input(captured: list[torch.Tensor], module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook of the output head: keep its input, and let the head compute the first position only."""
    captured.append(args[0])
    return (args[0][..., :1, :], *args[1:])
