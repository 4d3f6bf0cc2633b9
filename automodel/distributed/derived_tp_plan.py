"""A TP plan derived from the model itself, for a model whose class declares none (and that gets none from the user or a
sidecar): precedence user > sidecar > model > derived (:func:`tensor_parallel.choose_tp_plan`).

Roles come from the data flow of one forward on the meta device, not from names. A twin of the model on meta (no
memory) runs ``input_ids`` of one short sequence while a dispatch mode tags every tensor with the linear layers it was
computed from (``Tensor.item()`` on meta, which masks and position code call, answers 0: the trace only needs the
data flow, not the values). In each decoder layer:

- a *pair* is a linear layer (the exit) and the set ``G`` of linear layers of its decoder layer that its input depends
  on, where the members of ``G`` are parallel (none depends on another), and each feeds that exit alone, neither
  another linear layer nor the layer's output (the residual stream): attention (``q, k, v -> o``) and MLPs
  (``gate, up -> down``, ``fc1 -> fc2``). ``G`` becomes ``colwise``, the exit ``rowwise``: each rank computes a slice
  of the features between them, and the exit's all-reduce restores the full activation, so the members of ``G`` read
  a replicated activation wherever they sit.

Everything else stays replicated: mixers with linear layers in the middle (Mamba's ``x_proj``), routers, experts,
cross-attention the causal forward never runs. A pair is kept only when it is safe to shard:

- no member's output is split or sliced into parts (a fused ``c_attn`` / ``Wqkv`` packs q, k and v in one weight,
  and contiguous slices of it would hand a rank all of q and none of v). Members are ``nn.Linear`` or GPT-2's
  ``Conv1D`` (weight stored ``(in, out)``, which the styles shard on its other dimension);
- the features divide ``tp_size``; when the pair computes attention (a matmul of two of its outputs), the config's
  head counts divide ``tp_size`` (else the attention stays replicated; a declared plan is refused instead);
- a forward on meta with this pair's weights cut to one rank's local shapes runs and gives the same shapes (a model
  that reshapes to ``config.num_attention_heads`` heads, or normalises the sliced features as a whole, fails here).

The head (an untied ``nn.Linear``) becomes ``colwise_gather_output`` when the vocabulary divides ``tp_size``. A model
with nothing safe to shard is refused, naming what was found. What the trace cannot see the first forward checks:
a replicated module that computes on a sharded activation gets its gradient summed over TP
(:mod:`partial_gradients`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel._compat.torch import TorchDispatchMode, tree_leaves
from automodel._compat.transformers import replace_layer_number_by_wildcard

from .meta_trace import FakeScalars, eager_experts, fake_data_dependent, meta_forward, meta_twin
from .model_structure import attention_head_counts, decoder_layers, output_embeddings, tied_parameter_names
from .tp_styles import is_conv1d

__all__ = ["DERIVED_SOURCE", "derive_tp_plan"]

logger = logging.getLogger(__name__)

#: The source a derived plan reports (``TP over tp=2 (plan: 14 rules derived from the module tree)``).
DERIVED_SOURCE = "derived from the module tree"
# Prime and odd: a forward that folds a rank's missing heads into the sequence (``view(batch, -1, num_heads,
# head_dim)``, OPT) cannot divide it, so the local-shape trial fails instead of silently running on half a sequence.
_SEQUENCE_LENGTH = 13
_aten = torch.ops.aten
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.slice.Tensor, _aten.narrow.default}
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


@dataclass(frozen=True)
class _Pair:
    """One colwise group and its rowwise exit, as wildcard rule keys, with the concrete modules of every layer."""

    entries: tuple[str, ...]
    exit: str
    modules: tuple[tuple[tuple[str, ...], str], ...]
    attention: bool

    def describe(self) -> str:
        return f"{', '.join(self.entries)} -> {self.exit}"


class _Trace(TorchDispatchMode):
    """Tags every tensor with the linear layers it is computed from; answers ``item()`` on meta with 0."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # every tagged tensor, so that no id is reused during the trace
        self.produced_by: dict[int, str] = {}  # id of a linear's output -> its name
        self.inputs: dict[str, frozenset[str]] = {}  # linear -> the linears its input depends on
        self.split: set[str] = set()  # linears whose output features are cut into parts (packed projections)
        self.unflattened: dict[int, tuple[str, int]] = {}  # id of a view of a linear's output -> (linear, its dim)
        self.mixed: list[frozenset[str]] = []  # the sources of each matmul of two traced operands
        self.layer_outputs: dict[str, frozenset[str]] = {}  # decoder layer -> the sources of its hidden states
        self.output_shape: tuple[int, ...] = ()  # the logits' shape with whole weights
        self.running: list[str] = []  # the modules whose forward is running, outermost first

    def tag_of(self, tree: Any) -> frozenset[str]:
        tensors = [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
        return frozenset().union(*(self.tags.get(id(tensor), frozenset()) for tensor in tensors))

    def set_tag(self, tensor: torch.Tensor, tag: frozenset[str]) -> None:
        self.alive.append(tensor)
        self.tags[id(tensor)] = tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        faked = fake_data_dependent(func, args)
        if faked is not None:
            return faked
        out = func(*args, **kwargs)
        sources = self.tag_of((args, kwargs))
        if not sources:
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.set_tag(leaf, self.tags.get(id(leaf), frozenset()) | sources)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None:
            self._find_packing(func, args, kwargs, source, out)
        operands = [a for a in args if isinstance(a, torch.Tensor) and self.tags.get(id(a))]
        if len(operands) >= 2 and _is_matmul(func):
            self.mixed.append(sources)
        return out

    def _find_packing(self, func: Any, args: tuple, kwargs: dict, source: torch.Tensor, out: Any) -> None:
        """A linear layer's features cut into parts: split or sliced (``qkv.split(...)``), or viewed as ``(parts,
        features)`` and one part taken (``fc1(x).view(b, s, 2, -1)[..., 0, :]``, Moshi). A view into ``(heads,
        head_dim)`` whose heads are only transposed and multiplied is not packing."""
        if id(source) in self.produced_by and func in _VIEWS and isinstance(out, torch.Tensor):
            cut = out.ndim == source.ndim + 1 and tuple(out.shape[: source.ndim - 1]) == tuple(source.shape[:-1])
            if cut:
                self.unflattened[id(out)] = (self.produced_by[id(source)], source.ndim - 1)
        dim = _dim_argument(func, args, kwargs)
        if dim is None or source.ndim == 0:
            return
        dim = dim % source.ndim
        if id(source) in self.produced_by and dim == source.ndim - 1 and func in _SPLITS:
            self.split.add(self.produced_by[id(source)])
        elif id(source) in self.unflattened and self.unflattened[id(source)][1] == dim:
            self.split.add(self.unflattened[id(source)][0])


def _dim_argument(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The dimension a split, slice, select or unbind works along (``None`` for other ops)."""
    if func in (_aten.slice.Tensor, _aten.narrow.default, _aten.select.int, _aten.unbind.int):
        return args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if func in (_aten.split.Tensor, _aten.split_with_sizes.default):
        return args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return None


def _is_matmul(func: Any) -> bool:
    name = str(func)
    return "scaled_dot_product" in name or name.split(".")[1] in ("mm", "bmm", "baddbmm", "matmul", "addmm", "einsum")


def derive_tp_plan(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The TP plan this module's docstring describes, for ``model`` (on meta or materialised: it is traced on a meta
    twin, never run) and ``tp_size`` ranks. Raises ``ValueError`` naming the class and why when nothing can be
    sharded safely."""
    twin = meta_twin(model)
    name = type(model).__name__
    blocks = set(decoder_layers(twin))
    layers = {layer_name: layer for layer_name, layer in twin.named_modules() if layer in blocks}
    trace = _Trace()
    try:
        _trace(trace, twin, layers)
    except Exception as error:  # noqa: BLE001 - any failure of the meta forward makes the derivation impossible
        where = (
            f" in {trace.running[-1]} ({type(twin.get_submodule(trace.running[-1])).__name__})" if trace.running else ""
        )
        raise _refusal(
            name,
            f"its forward cannot be traced on the meta device: it fails{where} with {type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}",
        ) from error
    linears = {module_name: module for module_name, module in twin.named_modules() if _is_linear(module)}
    pairs, reasons, chained = _pairs(trace, layers, linears, tp_size)
    expected = trace.output_shape
    kept: list[_Pair] = []
    for pair in pairs:
        if pair.attention and (why := _heads_not_divisible(twin, tp_size)):
            reasons.append(f"{pair.describe()}: {why}")
        elif _fits_local_shapes(twin, [pair], tp_size, expected):
            kept.append(pair)
        else:
            reasons.append(f"{pair.describe()}: one rank's local shapes do not run through its forward")
    if kept and not _fits_local_shapes(twin, kept, tp_size, expected):
        reasons.append(f"{[pair.describe() for pair in kept]}: fit one by one, not together")
        kept = []
    reasons += chained
    if not kept:
        found = "; ".join(reasons[:4]) or "no linear layers in its decoder layers"
        raise _refusal(name, f"nothing in its decoder layers can be sharded safely ({found})")
    plan = {entry: "colwise" for pair in kept for entry in pair.entries} | {pair.exit: "rowwise" for pair in kept}
    head = _head_rule(twin, tp_size)
    plan.update(head)
    if reasons:
        logger.debug("%s: derived TP plan leaves replicated: %s", name, reasons)
    return plan


def _refusal(name: str, why: str) -> ValueError:
    return ValueError(
        f"{name} has no tensor-parallel plan (no `_tp_plan` on the class and no `base_model_tp_plan` on its config), "
        f"and none can be derived from its module tree: {why}. Supply one with transformers style names, e.g. "
        '{"model.layers.*.self_attn.q_proj": "colwise", ...}: pass `tp_plan=` to from_pretrained / from_config, or set '
        "`_tp_plan` on a sidecar ModelParallelizer subclass (model_sidecars/<model>/parallelization.py), or pass "
        "`tp_shard_plan` to its `_apply`. Or use tp_size=1."
    )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


@contextmanager
def _hooks(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _trace(trace: _Trace, twin: nn.Module, layers: dict[str, nn.Module]) -> None:
    eager_experts(twin)
    handles = []
    for module_name, module in twin.named_modules():
        if module_name:
            handles.append(module.register_forward_pre_hook(_enter(trace, module_name)))
            handles.append(module.register_forward_hook(_leave(trace)))
        if _is_linear(module):
            handles.append(module.register_forward_pre_hook(_record_input(trace, module_name), with_kwargs=True))
            handles.append(module.register_forward_hook(_tag_output(trace, module_name)))
    for layer_name, layer in layers.items():
        handles.append(layer.register_forward_hook(_record_layer_output(trace, layer_name)))
    with _hooks(handles), trace:
        trace.output_shape = _output_shape(meta_forward(twin, _SEQUENCE_LENGTH))


def _enter(trace: _Trace, name: str):
    def hook(module, args):
        trace.running.append(name)

    return hook


def _leave(trace: _Trace):
    def hook(module, args, output):
        trace.running.pop()

    return hook


def _record_input(trace: _Trace, name: str):
    def hook(module, args, kwargs):
        trace.inputs[name] = trace.inputs.get(name, frozenset()) | trace.tag_of((args, kwargs))

    return hook


def _tag_output(trace: _Trace, name: str):
    def hook(module, args, output):
        trace.set_tag(output, frozenset({name}))
        trace.produced_by[id(output)] = name

    return hook


def _record_layer_output(trace: _Trace, name: str):
    def hook(module, args, output):
        first = next((leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)), None)
        trace.layer_outputs[name] = trace.tags.get(id(first), frozenset()) if first is not None else frozenset()

    return hook


def _pairs(
    trace: _Trace, layers: dict[str, nn.Module], linears: dict[str, nn.Module], tp_size: int
) -> tuple[list[_Pair], list[str], list[str]]:
    """The pairs of every decoder layer, merged over layers by wildcard key (a key with two roles is dropped), and
    why other groups are not pairs: of groups that read the layer's input, then of groups around another exit."""
    found: dict[tuple[tuple[str, ...], str], list[tuple[tuple[str, ...], str]]] = {}
    attention: set[tuple[tuple[str, ...], str]] = set()
    reasons: list[str] = []
    chained: list[str] = []
    for layer_name, _layer in layers.items():
        # In call order (trace.inputs is filled as the forward runs), not set order: every rank must derive the same
        # plan and word a refusal the same way, and set order of strings differs between processes.
        order = [name for name in trace.inputs if name.startswith(f"{layer_name}.")]
        own = frozenset(order)
        deps = {name: trace.inputs[name] & own for name in order}
        for exit_name, needs in deps.items():
            if not needs or any(deps[name] & needs for name in needs):
                continue
            group = tuple(sorted(needs))
            key = (tuple(sorted({_wild(name) for name in group})), _wild(exit_name))
            why = _unsafe(group, exit_name, deps, trace, linears, layer_name, tp_size)
            if why:
                # A group around another pair's exit (o_proj -> gate_proj) is what every residual block looks
                # like: listed after the reasons that keep a real block replicated.
                listed = chained if any(deps[name] for name in group) else reasons
                if why not in listed:
                    listed.append(why)
                continue
            found.setdefault(key, []).append((group, exit_name))
            if any(sources and sources <= set(group) for sources in trace.mixed):
                attention.add(key)
    roles: dict[str, set[str]] = {}
    for entries, exit_key in found:
        for entry in entries:
            roles.setdefault(entry, set()).add("colwise")
        roles.setdefault(exit_key, set()).add("rowwise")
    pairs = []
    for (entries, exit_key), modules in found.items():
        if any(len(roles[key]) > 1 for key in (*entries, exit_key)) or sum(exit_key == e for _, e in found) > 1:
            reasons.append(f"{', '.join(entries)} -> {exit_key}: a module with two roles across layers")
            continue
        pairs.append(_Pair(entries, exit_key, tuple(modules), (entries, exit_key) in attention))
    return pairs, reasons, chained


def _wild(name: str) -> str:
    return replace_layer_number_by_wildcard(name)


def _unsafe(
    group: tuple[str, ...],
    exit_name: str,
    deps: dict[str, frozenset[str]],
    trace: _Trace,
    linears: dict[str, nn.Module],
    layer_name: str,
    tp_size: int,
) -> str | None:
    """Why sharding ``group -> exit_name`` would be wrong or impossible (``None``: it may be tried)."""
    label = f"{', '.join(map(_wild, group))} -> {_wild(exit_name)}"
    for name in group:
        if any(name in needs for other, needs in deps.items() if other != exit_name):
            return f"{label}: {_wild(name)} also feeds another linear layer"
        if name in trace.layer_outputs.get(layer_name, frozenset()):
            return f"{label}: {_wild(name)} reaches the layer's output around {_wild(exit_name)}"
        if name in trace.split:
            return f"{label}: {_wild(name)} packs several projections in one weight (its output is split)"
    for name in group:
        if (features := _features(linears[name])[1]) % tp_size:
            return f"{label}: {_wild(name)} has {features} output features, not divisible by {tp_size}"
    return None


def _features(module: nn.Module) -> tuple[int, int]:
    """A linear layer's ``(in_features, out_features)``; a ``Conv1D`` calls them ``nx`` and ``nf``."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def _set_local_weight(module: nn.Module, in_features: int, out_features: int) -> None:
    """Give a linear layer (on meta) the weight shape of ``in_features`` by ``out_features``, in its own layout."""
    if is_conv1d(module):
        module.nx, module.nf = in_features, out_features  # its forward views the output to `nf` features
        module.weight = nn.Parameter(torch.empty(in_features, out_features, device="meta"))
    else:
        module.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"))


def _heads_not_divisible(model: nn.Module, tp_size: int) -> str | None:
    for label, count in attention_head_counts(model).items():
        if count % tp_size:
            return f"{label}={count} is not divisible by tp_size={tp_size}"
    return None


def _fits_local_shapes(twin: nn.Module, pairs: list[_Pair], tp_size: int, expected: tuple[int, ...]) -> bool:
    """Whether the forward runs, with the ``expected`` output shape, when ``pairs`` hold one rank's local shapes."""
    trial = meta_twin(twin)
    for pair in pairs:
        for group, exit_name in pair.modules:
            for name in group:
                module = trial.get_submodule(name)
                in_features, out_features = _features(module)
                _set_local_weight(module, in_features, out_features // tp_size)
                if module.bias is not None:
                    module.bias = nn.Parameter(torch.empty(out_features // tp_size, device="meta"))
            module = trial.get_submodule(exit_name)
            in_features, out_features = _features(module)
            if in_features % tp_size:
                return False
            _set_local_weight(module, in_features // tp_size, out_features)
    try:
        return _logits_shape(trial) == expected
    except Exception:  # noqa: BLE001 - any failure means these local shapes do not fit the model's forward
        return False


def _logits_shape(model: nn.Module) -> tuple[int, ...]:
    with FakeScalars():
        return _output_shape(meta_forward(model, _SEQUENCE_LENGTH))


def _output_shape(output: Any) -> tuple[int, ...]:
    """The shape of a forward's logits (else of its first tensor)."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return tuple(logits.shape)
    return tuple(next(leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)).shape)


def _head_rule(model: nn.Module, tp_size: int) -> dict[str, str]:
    """``colwise_gather_output`` on an untied linear head whose vocabulary divides ``tp_size``."""
    head = output_embeddings(model)
    if not isinstance(head, nn.Linear) or head.out_features % tp_size:
        return {}
    tied = {name for group in tied_parameter_names(model) for name in group}
    head_name = next(name for name, module in model.named_modules() if module is head)
    if f"{head_name}.weight" in tied:
        return {}
    return {head_name: "colwise_gather_output"}
