"""Gradient norm and clipping over a model's gradients on any layout: ``torch.nn.utils.clip_grad_norm_``'s contract,
for parameters that live on several meshes.

Under TP, FSDP2 and HSDP every parameter of a model is a DTensor on one mesh, and torch's own function works. Under
EP (experts on the ``ep_shard`` / ``ep`` meshes, dense weights on ``dp_shard_cp``) the gradients live on different
meshes, where one foreach norm cannot mix them. Here each group of gradients with the same mesh and placements is
reduced with DTensor's own norm (which reduces over the shards), and the groups' norms are combined. Under pipeline
parallelism each rank's norm is then combined over the ``pp`` group (a tied head counted once).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .pipelined_model import pipeline_norm_group
from .runtime import collective_device, full_tensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(parameters: Iterable[nn.Parameter] | torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type``-norm of all gradients (those that exist), as one plain float32 tensor on the
    gradients' device, the same on every rank. Collective when gradients are sharded: every rank must call it."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    pipeline = [pipeline_norm_group(param) for param in parameters]
    pp_groups = {entry[0] for entry in pipeline if entry is not None}
    # A tied head on the last stage is the same weight as the first stage's embedding: its gradient counts once.
    parameters = [param for param, entry in zip(parameters, pipeline, strict=True) if entry is None or entry[1]]
    local = _local_grad_norm(parameters, norm_type)
    if not pp_groups:
        return local
    # Each pipeline rank holds other layers: combine their norms over the ``pp`` group.
    (group,) = pp_groups
    combined = local.to(collective_device())
    if norm_type == float("inf"):
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
        return combined.to(local.device)
    combined = combined**norm_type
    dist.all_reduce(combined, group=group)
    return (combined ** (1.0 / norm_type)).to(local.device)


def _local_grad_norm(parameters: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is None:
            continue
        grad = param.grad
        key = (id(grad.device_mesh), grad.placements) if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=_foreach_norm(grads[0]))
        norms.append(full_tensor(norm).float())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    device = norms[0].device
    return torch.nn.utils.get_total_norm([norm.to(device) for norm in norms], norm_type=norm_type, foreach=False)


def _foreach_norm(grad: torch.Tensor) -> bool | None:
    """One foreach norm per group where torch has one (CUDA: a few kernels instead of one DTensor dispatch per
    gradient, which costs ~0.15 ms of host time each), except for ``Partial`` gradients (sequence parallelism's),
    which go through DTensor's per-tensor norm, the path tested on every layout."""
    if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
        return False
    return None  # torch's default: foreach where supported


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a parallelized model on any layout (TP, FSDP2, HSDP, EP, CP, DDP):
    scale the gradients so their global norm is at most ``max_norm``; return the norm before clipping (on the
    gradients' device, as torch's). Collective: call it on every rank, with every parameter of the model (under
    pipeline parallelism a rank whose list names no parameter of its stages cannot join the stages' norm)."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # Every parameter decides the pipeline's norm reduction, with a gradient or not: a stage whose parameters are all
    # frozen (a pipeline stage without LoRA adapters) must still join it, or the other stages wait for it.
    total = total_grad_norm(parameters, norm_type)
    parameters = [param for param in parameters if param.grad is not None]
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so they cannot be "
            "clipped. Pass error_if_nonfinite=False to clip anyway."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # The local shards are scaled (a Partial gradient's pieces too: scaling each scales their sum), with the
    # coefficient moved to each device once: no DTensor dispatch and no host-to-device copy per gradient.
    coefficients: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for param in parameters:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if grad.device not in coefficients:
                coefficients[grad.device] = coefficient.to(grad.device)
            grad.mul_(coefficients[grad.device])
    return total
