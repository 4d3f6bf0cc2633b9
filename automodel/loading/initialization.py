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
size. Non-persistent buffers (rotary ``inv_freq``, position ids) are recomputed the same way, as transformers does
after a meta-device build.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from automodel._compat.transformers import guard_torch_init_functions, mark_initialized

from .placements import local_indices, to_runs

__all__ = ["initialize_missing", "local_view", "module_seed", "non_persistent_buffer_names"]


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
    of the full tensor. The caller's CPU generator state is restored afterwards."""
    if not names:
        return
    owners = _init_owners(model)
    generator_state = torch.random.get_rng_state()
    try:
        with torch.no_grad(), guard_torch_init_functions():
            for module_name, module in _post_order(model):
                prefix = f"{module_name}." if module_name else ""
                own = {
                    name
                    for name, value in [*module._parameters.items(), *module._buffers.items()]
                    if value is not None and f"{prefix}{name}" in names
                }
                if own:
                    # Only the CPU generator: the stand-ins live on the CPU, and an accelerator's RNG stays untouched.
                    torch.random.default_generator.manual_seed(module_seed(seed, module_name))
                    _initialize_module(owners[module], module, own)
    finally:
        torch.random.set_rng_state(generator_state)


def _initialize_module(owner: nn.Module, module: nn.Module, names: set[str]) -> None:
    originals: dict[str, tuple[dict, torch.Tensor]] = {}
    for store in (module._parameters, module._buffers):
        for name, value in list(store.items()):
            if value is None:
                continue
            full = torch.empty(value.shape, dtype=value.dtype, device="cpu")
            if isinstance(value, nn.Parameter):
                full = nn.Parameter(full, requires_grad=value.requires_grad)
            if name not in names:
                mark_initialized(full)
            originals[name] = (store, value)
            store[name] = full
    # Some inits also write the tensors of the module's children (CLIP's vision embeddings draw their patch and
    # position embeddings when asked for the `position_ids` buffer): those are loaded (or initialised on their own
    # module's visit, which comes first), so transformers' guarded init functions must leave them alone too.
    flagged = [
        value
        for child in module.children()
        for value in [*child.parameters(), *child.buffers()]
        if not getattr(value, "_is_hf_initialized", False)
    ]
    for value in flagged:
        value._is_hf_initialized = True
    try:
        owner._init_weights(module)
        for name in names:
            store, original = originals[name]
            full = store[name]
            local_view(original).copy_(_local_part(full.detach(), local_indices(original)))
    finally:
        for name, (store, original) in originals.items():
            store[name] = original
        for value in flagged:
            del value._is_hf_initialized


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
