"""Initialise what the checkpoint does not provide (or, for ``from_config``, everything), with the model's own
``_init_weights``, module by module into the local shards.

Random init of a sharded parameter in place would draw the same numbers on every rank (CPU has no DTensor RNG
tracker), giving copies of one shard instead of one initialised tensor. So each module that owns something to
initialise gets full-size CPU stand-ins for its own tensors (not its children's), transformers' ``_init_weights``
runs on those (loaded tensors are flagged ``_is_hf_initialized`` so it leaves them alone), every rank copies its own
slices into its shards, and the stand-ins are freed before the next module: peak host memory is the local shards
plus the largest single module.

The CPU generator is seeded per module from ``(seed, module name)``, so a module's values depend on neither the
order modules are visited in nor which others are initialised: the weights are the same on every layout and world
size.

Non-persistent buffers (rotary ``inv_freq``, position ids, Falcon-H1's ``mup_vector``) are computed again the way
transformers' ``initialize_weights`` computes them after its own meta-device build: every module's ``_init_weights``
runs children first, so an ancestor's init may write a descendant's buffer and has the last word (FalconH1Model's
init writes every layer's ``mamba.mup_vector``). Buffers are whole on every rank, so ancestors write them in place.

Nothing uninitialised reaches a model: every write an init makes is seen (a dispatch mode records the storages that
in-place and ``out=`` ops write, ``.data`` writes and slices included), and a tensor that neither the checkpoint nor
any init wrote is an :class:`UninitializedTensorError` naming it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from automodel._compat.torch import TorchDispatchMode, mutated_tensors
from automodel._compat.transformers import guard_torch_init_functions, mark_initialized
from automodel.distributed.megatron_fsdp import is_megatron_fsdp_parameter

from .placements import local_indices, to_runs

__all__ = [
    "UninitializedTensorError",
    "initialize_missing",
    "local_view",
    "module_seed",
    "non_persistent_buffer_names",
]


class UninitializedTensorError(RuntimeError):
    """Tensors that neither the checkpoint nor the model's own ``_init_weights`` gives a value: after a meta-device
    build they would hold whatever memory they were allocated in."""


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually stores (the local shard of a ``DTensor``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def non_persistent_buffer_names(model: nn.Module) -> set[str]:
    """Names of buffers that are not part of the state dict (and so never in a checkpoint)."""
    names = set()
    for module_name, module in model.named_modules():
        for buffer_name in module._non_persistent_buffers_set:
            if module._buffers.get(buffer_name) is not None:
                names.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def module_seed(seed: int, module_name: str) -> int:
    """The CPU generator's seed for initialising module ``module_name`` (its full name, ``""`` for the root): a hash
    of both, the same on every rank, layout and world size."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initialize_missing(model: nn.Module, names: set[str], *, seed: int = 0) -> None:
    """Initialise the parameters and buffers in ``names`` (full names) with the model's own init, consistently
    across ranks and layouts: each module's draws are seeded from ``(seed, its name)``, and each rank keeps its part
    of the full tensor. The caller's CPU generator state is restored afterwards.

    Raises :class:`UninitializedTensorError` (on every rank alike: it depends on the model only) when some tensor of
    ``names`` was written by no init.
    """
    if not names:
        return
    owners = _init_owners(model)
    slots = _slots(model, names)
    unwritten = set(names)
    # Per module: the names in its subtree that an ancestor's init may still write (buffers, whose last writer is
    # the outermost init that writes them, and tensors no init has written yet).
    open_below: dict[str, set[str]] = {}
    generator_state = torch.random.get_rng_state()
    try:
        with torch.no_grad(), guard_torch_init_functions():
            for module_name, module in _post_order(model):
                prefix = f"{module_name}." if module_name else ""
                own = {f"{prefix}{name}" for name, value in _own_tensors(module) if f"{prefix}{name}" in names}
                below = set().union(
                    *(open_below.pop(f"{prefix}{child}", set()) for child, _ in module.named_children())
                )
                if own or below:
                    # Only the CPU generator: the stand-ins live on the CPU, and an accelerator's RNG stays untouched.
                    torch.random.default_generator.manual_seed(module_seed(seed, module_name))
                    written = _initialize_module(owners[module], module, prefix, own, {n: slots[n] for n in below})
                    unwritten -= written
                open_below[module_name] = {n for n in own | below if slots[n].is_buffer or n in unwritten}
    finally:
        torch.random.set_rng_state(generator_state)
    if unwritten:
        raise UninitializedTensorError(_uninitialized_message(model, sorted(unwritten)))


@dataclass
class _Slot:
    """Where a tensor lives: ``store[attr]`` of its module (``_parameters`` or ``_buffers``)."""

    store: dict
    attr: str
    is_buffer: bool


def _slots(model: nn.Module, names: set[str]) -> dict[str, _Slot]:
    slots = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for store, is_buffer in ((module._parameters, False), (module._buffers, True)):
            for attr, value in store.items():
                if value is not None and f"{prefix}{attr}" in names:
                    slots[f"{prefix}{attr}"] = _Slot(store, attr, is_buffer)
    return slots


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, value) for name, value in [*module._parameters.items(), *module._buffers.items()] if value is not None
    ]


def _holds_whole(tensor: torch.Tensor) -> bool:
    """Whether this rank stores all of ``tensor`` (a buffer, an unsharded parameter)."""
    return not isinstance(tensor, DTensor) and not is_megatron_fsdp_parameter(tensor)


@dataclass
class _Target:
    """A tensor an init may write: the model's own (``original``) or a full-size CPU stand-in in its place."""

    name: str
    slot: _Slot
    original: torch.Tensor
    written_to: torch.Tensor  # what the init sees: the stand-in, or the original itself

    def written(self, storages: set[int]) -> bool:
        current = self.slot.store[self.slot.attr]
        return (
            current is not self.written_to  # assigned a new tensor (``module.inv_freq = ...``)
            or self.written_to.numel() == 0
            or self.written_to.untyped_storage().data_ptr() in storages
        )

    def commit(self) -> None:
        """Copy what the init wrote into this rank's part of the model's tensor, and put the tensor back."""
        value = self.slot.store[self.slot.attr]
        if value is not self.original:  # a stand-in, or a new tensor the init assigned
            local_view(self.original).copy_(_local_part(value.detach(), local_indices(self.original)))

    def restore(self) -> None:
        self.slot.store[self.slot.attr] = self.original


def _initialize_module(
    owner: nn.Module, module: nn.Module, prefix: str, own: set[str], below: dict[str, _Slot]
) -> set[str]:
    """Run ``owner._init_weights(module)`` with every tensor of ``own`` and ``below`` writable and every other tensor
    of the subtree flagged as initialised; commit what it wrote and return those names."""
    targets: list[_Target] = []
    for attr, value in _own_tensors(module):
        store = module._parameters if attr in module._parameters else module._buffers
        slot = _Slot(store, attr, store is module._buffers)
        stand_in = _stand_in(value)
        if f"{prefix}{attr}" not in own:
            mark_initialized(stand_in)
        targets.append(_Target(f"{prefix}{attr}", slot, value, stand_in))
        store[attr] = stand_in
    for name, slot in below.items():
        value = slot.store[slot.attr]
        written_to = value if _holds_whole(value) else _stand_in(value)
        targets.append(_Target(name, slot, value, written_to))
        slot.store[slot.attr] = written_to
    writable = {id(target.written_to) for target in targets if target.name in own or target.name in below}
    # Some inits also write the tensors of the module's descendants (CLIP's vision embeddings draw their patch and
    # position embeddings when asked for the `position_ids` buffer): those are loaded (or initialised on their own
    # module's visit, which comes first), so transformers' guarded init functions must leave them alone too.
    flagged = list(
        {
            id(value): value
            for child in module.children()
            for value in [*child.parameters(), *child.buffers()]
            if id(value) not in writable and not getattr(value, "_is_hf_initialized", False)
        }.values()
    )
    for value in flagged:
        mark_initialized(value)
    written: set[str] = set()
    try:
        with _RecordWrites() as recorder:
            owner._init_weights(module)
        for target in targets:
            if id(target.written_to) in writable and target.written(recorder.storages):
                target.commit()
                written.add(target.name)
    finally:
        for target in targets:
            target.restore()
        for value in flagged:
            del value._is_hf_initialized
    return written


def _stand_in(value: torch.Tensor) -> torch.Tensor:
    full = torch.empty(value.shape, dtype=value.dtype, device="cpu")
    return nn.Parameter(full, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else full


class _RecordWrites(TorchDispatchMode):
    """The storages that in-place and ``out=`` ops write while it is active (guarded init functions, ``.data``
    writes and writes into slices all end in such an op)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in mutated_tensors(func, args, kwargs):
            if type(tensor) in (torch.Tensor, nn.Parameter):
                self.storages.add(tensor.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _uninitialized_message(model: nn.Module, names: list[str]) -> str:
    owner = type(model).__name__
    shown = ", ".join(names[:8]) + (f" ... and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{shown}: no value for {'this tensor' if len(names) == 1 else 'these tensors'} of {owner}. The checkpoint "
        f"does not hold them (non-persistent buffers never are) and no `_init_weights` of the model writes them, so "
        f"after the meta-device build they would hold uninitialised memory (plain transformers' from_pretrained "
        f"leaves them the same way). Make the model's `_init_weights` compute them (e.g. "
        f"`transformers.initialization.copy_(module.<buffer>, value)`), or load a checkpoint that holds them."
    )


def _local_part(full: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """``full[ix_(indices)]``: a view where each dim's indices are one contiguous run (the usual shard), so no copy
    of the slice is made next to the full-size temporary; an index copy otherwise."""
    for dim, dim_indices in enumerate(indices):
        runs = to_runs(dim_indices)
        if len(runs) == 1:
            full = full.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        else:
            full = full.index_select(dim, dim_indices)
    return full


def _init_owners(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """For each module, the closest ``PreTrainedModel`` at or above it, whose ``_init_weights`` applies (the
    dispatch transformers' ``initialize_weights`` does for composite models)."""
    owners: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[module] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return owners


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules children-first, as ``nn.Module.apply`` (and transformers' init) visits them."""
    order: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order
