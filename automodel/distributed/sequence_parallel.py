"""Sequence parallelism inside TP: activations between TP regions stay sharded over the sequence.

The sequence is split when it enters the first decoder layer and gathered when it leaves the last, so embeddings,
rotary positions, masks, the final norm and the head see the whole sequence as usual. Inside a layer each block
(child module) takes one of three forms:

- TP-sharded with sequence-parallel styles (attention, MLP): colwise projections all-gather the sequence, rowwise
  projections reduce-scatter onto it;
- per-token with replicated 1-D parameters (norms): run on sequence shards, their gradients summed over TP;
- everything else (routed experts, which TP shards as whole-expert slices or EP owns; mixers, convolutions and scans
  TP leaves replicated): run on the whole sequence exactly as without SP, every output laid out like the hidden
  states cut back to this rank's shard.

A decoder layer's own parameters (used on sequence shards) get their gradients summed over TP as well. A style that
has no sequence-parallel form in a sharded block is refused, naming the module.

A model with an encoder tower (a vision-language model) takes SP on its language decoder's layers only, and its
hidden states are whole between those layers: the sequence is split when it enters each layer and gathered when it
leaves it, because such models may merge encoder features into the hidden states between layers by whole-sequence
positions (Qwen3-VL's deepstack). The encoder's blocks, replicated over TP, run as without SP.

:func:`sequence_parallel_layout` decides all of it from the plan and the module tree (and refuses), touching nothing;
:func:`install_sequence_parallel` installs the hooks it says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from automodel._compat.torch import tree_map_only

from .adapters import LOCAL_INPUT_STYLE
from .model_structure import decoder_layers, encoder_tower_blocks
from .tp_styles import SequenceParallelNorm, SequenceParallelRowwise, TensorParallelLayer, owned_local, style_named

__all__ = [
    "SequenceParallelLayout",
    "install_sequence_parallel",
    "sequence_parallel_layout",
    "sequence_parallel_styles",
]

logger = logging.getLogger(__name__)

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
# The style of a routed-experts module under TP: its block runs on the whole sequence.
_ROUTED_EXPERTS_STYLE = "moe_tp_experts"


@dataclass(frozen=True)
class SequenceParallelLayout:
    """What SP does to a model, by module name: the styles it replaces (``"norm"``: per-token with replicated 1-D
    parameters; ``"rowwise"``: reduce-scatter onto the sequence; ``"grad_allreduce"``: a layer's own parameters), the
    sharded blocks whose input is all-gathered, the blocks run on the whole sequence, and where the sequence is split
    and gathered (pairs of first and last layer)."""

    converted: dict[str, str]
    gathered_blocks: tuple[str, ...]
    whole_sequence: tuple[str, ...]
    boundaries: tuple[tuple[str, str], ...]


def sequence_parallel_layout(model: nn.Module, expanded: dict[str, str]) -> SequenceParallelLayout:
    """The SP layout of ``model`` under the TP plan ``expanded`` (exact names); raises, naming the module, for a
    style without a sequence-parallel form in a sharded block. Touches nothing."""
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    layers = [layer for layer in decoder_layers(model) if id(layer) not in encoder]
    layer_names = {module: name for name, module in model.named_modules()}
    converted: dict[str, str] = {}
    gathered: list[str] = []
    whole: list[str] = []
    for layer in layers:
        if next(layer.parameters(recurse=False), None) is not None:
            converted[layer_names[layer]] = "grad_allreduce"
        for child_name, child in layer.named_children():
            full_name = f"{layer_names[layer]}.{child_name}"
            entries = {
                key: style for key, style in expanded.items() if key == full_name or key.startswith(f"{full_name}.")
            }
            if entries and _ROUTED_EXPERTS_STYLE not in entries.values():
                converted.update(_sharded_block_forms(entries))
                gathered.append(full_name)
            elif entries or any(param.ndim != 1 for param in child.parameters()):
                whole.append(full_name)
            elif next(child.parameters(), None) is not None:
                converted[full_name] = "norm"
    pairs = [(layer, layer) for layer in layers] if encoder else [(layers[0], layers[-1])]
    boundaries = tuple((layer_names[first], layer_names[last]) for first, last in pairs)
    return SequenceParallelLayout(converted, tuple(gathered), tuple(whole), boundaries)


def _sharded_block_forms(entries: dict[str, str]) -> dict[str, str]:
    forms = {}
    for name, style_name in entries.items():
        if style_name not in _SEQUENCE_PARALLEL_FORMS:
            raise ValueError(
                f"Sequence parallelism cannot follow the TP style {style_name!r} of {name}: it supports "
                f"{sorted(_SEQUENCE_PARALLEL_FORMS)} inside decoder layers (and whole routed-experts blocks). Use "
                "sequence_parallel=False for this model, or a TP plan without that style."
            )
        if _SEQUENCE_PARALLEL_FORMS[style_name] is not None:
            forms[name] = "rowwise"
    return forms


def sequence_parallel_styles(
    layout: SequenceParallelLayout, styles: dict[str, TensorParallelLayer]
) -> dict[str, TensorParallelLayer]:
    """``styles`` with the layout's replacements."""
    forms = {
        "grad_allreduce": lambda: style_named("replicated_with_grad_allreduce"),
        "norm": SequenceParallelNorm,
        "rowwise": SequenceParallelRowwise,
    }
    return {**styles, **{name: forms[form]() for name, form in layout.converted.items()}}


def install_sequence_parallel(model: nn.Module, layout: SequenceParallelLayout, mesh: DeviceMesh) -> None:
    """Install the hooks of ``layout`` on ``model``: gathers before the sharded blocks, whole-sequence wrappers, and
    the split and the gather at the boundaries."""
    modules = dict(model.named_modules())
    for name in layout.gathered_blocks:
        modules[name].register_forward_pre_hook(_gather_block_input_hook(mesh), with_kwargs=True)
    if layout.whole_sequence:
        logger.debug("Sequence parallelism: blocks run on the whole sequence: %s", list(layout.whole_sequence))
    for name in layout.whole_sequence:
        _run_on_whole_sequence(modules[name], mesh)
    for first, last in layout.boundaries:
        modules[first].register_forward_pre_hook(_scatter_sequence_hook(mesh), with_kwargs=True)
        modules[last].register_forward_hook(_gather_sequence_hook(mesh))


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
