"""Running a model's forward on the meta device, for what its data flow and call order say (the derived TP plan,
pipeline stage splitting): a memory-free twin of the model, one forward of a short ``input_ids``, and the answers
meta tensors cannot give (``item()``, ``nonzero``) faked."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from automodel._compat.torch import TorchDispatchMode, distribution_checks_off

__all__ = ["FakeScalars", "eager_experts", "fake_data_dependent", "meta_forward", "meta_twin"]

_aten = torch.ops.aten


def meta_twin(model: nn.Module, shared: tuple[object, ...] = ()) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors of the same shapes (no memory, no data copied); the
    objects in ``shared`` are referenced, not copied."""
    memo: dict[int, Any] = {id(thing): thing for thing in shared}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def meta_forward(model: nn.Module, sequence_length: int) -> Any:
    """``model(input_ids=...)`` of one sequence of ``sequence_length`` tokens on meta, without gradients or cache."""
    input_ids = torch.zeros(1, sequence_length, dtype=torch.long, device="meta")
    # Distributions check their arguments' values (BLT's patcher samples one), which meta tensors do not have.
    with torch.no_grad(), distribution_checks_off():
        return model(input_ids=input_ids, use_cache=False)


class FakeScalars(TorchDispatchMode):
    """Answers what a meta tensor has no values for (:func:`fake_data_dependent`); runs everything else."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        faked = fake_data_dependent(func, args)
        return func(*args, **(kwargs or {})) if faked is None else faked


def fake_data_dependent(func: Any, args: tuple) -> Any:
    """``item()`` of a meta tensor answers 0 (False), ``nonzero`` nothing: values a meta tensor does not have.
    ``None`` for every other op."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_meta:
        return None
    if func is _aten._local_scalar_dense.default:
        dtype = args[0].dtype
        return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
    if func is _aten.nonzero.default:
        return torch.empty((0, args[0].ndim), dtype=torch.long, device="meta")
    if func is _aten.index.Tensor and any(_is_mask(index) for index in args[1]):
        # A boolean mask selects no element (a meta tensor has no values): the same as indexing with no position.
        nothing = torch.empty(0, dtype=torch.long, device="meta")
        return func(args[0], [nothing if _is_mask(index) else index for index in args[1]])
    return None


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def eager_experts(twin: nn.Module) -> None:
    """Make a meta twin run its routed experts as transformers' ``eager`` loop: the ``grouped_mm`` kernel refuses
    fp32 meta operands, and a trace needs only the data flow and the call order."""
    seen: set[int] = set()
    for module in twin.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_experts_implementation"):
            seen.add(id(config))
            config._experts_implementation = "eager"
