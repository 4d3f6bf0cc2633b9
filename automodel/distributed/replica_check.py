"""The first backward of a model under a derived TP plan checks that every parameter replicated over TP got the same
gradient on every TP rank.

A replicated parameter computes the same thing on every TP rank, so its gradient must be the same everywhere. When it
is not, a module the plan leaves replicated computed on a sharded activation in a way the first-forward detection
(:mod:`partial_gradients`) could not see, and each rank holds the gradient of its own slice only: training on would
silently diverge the replicas. So at the end of the first backward each TP rank sums every such gradient (and its
squares), one all-reduce over ``tp`` compares them, and a difference is a ``ValueError`` naming the parameters, raised
from ``backward()`` on every TP rank alike. The cost is one reduction over the local gradients and one collective of
two floats per parameter, once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from automodel._compat.torch import at_end_of_backward, tree_leaves

__all__ = ["check_replicated_gradients_once"]

# Sums of float32 gradients reduced in a different order on different ranks still agree to this relative tolerance.
_RELATIVE_TOLERANCE = 1e-5


def check_replicated_gradients_once(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Arm the check on ``model``: the next forward with gradients hooks its outputs, and the end of their backward
    (after FSDP2 has reduced and placed the gradients) compares the replicated gradients over ``tp_mesh``."""
    state: dict[str, Any] = {"armed": True}

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        handle.remove()
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: _queue_once(state, model, tp_mesh))

    handle = model.register_forward_hook(forward_hook)


def _queue_once(state: dict[str, Any], model: nn.Module, tp_mesh: DeviceMesh) -> None:
    if state["armed"]:
        state["armed"] = False
        # Queued from a callback, the check runs after every callback the backward already holds (FSDP2's last).
        at_end_of_backward(lambda: at_end_of_backward(lambda: _compare(model, tp_mesh)))


def _compare(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    names, stats = [], []
    for name, param in model.named_parameters():
        # A gradient still Partial over tp (a sequence-parallel norm's) is a sum DTensor performs later, not a replica.
        if (
            param.grad is None
            or not _replicated_over_tp(param, tp_mesh)
            or not _replicated_over_tp(param.grad, tp_mesh)
        ):
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        grad = grad.detach().double()
        names.append(name)
        stats.append(torch.stack([grad.sum(), grad.square().sum()]))
    if not names:
        return
    local = torch.stack(stats).flatten()
    extremes = torch.cat([local, -local])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=tp_mesh.get_group())
    highest, lowest = extremes[: local.numel()], -extremes[local.numel() :]
    spread = (highest - lowest) > _RELATIVE_TOLERANCE * torch.clamp(highest.abs(), min=1.0)
    diverged = sorted({names[index // 2] for index in spread.nonzero().flatten().tolist()})
    if diverged:
        raise ValueError(
            f"{type(model).__name__}: parameters the TP plan replicates got different gradients on the TP ranks "
            f"after the first backward: {diverged[:10]}{' ...' if len(diverged) > 10 else ''}. A module the plan "
            "leaves replicated computes on a sharded activation, so each rank sees its own slice's gradient only. "
            "Mark that module 'replicated_with_grad_allreduce' or shard it in a tp_plan= of your own, or use "
            "tp_size=1."
        )


def _replicated_over_tp(param: torch.Tensor, tp_mesh: DeviceMesh) -> bool:
    """A tensor every TP rank holds whole: a plain tensor, or a DTensor replicated on its mesh's ``tp`` dim."""
    if not isinstance(param, DTensor):
        return True
    names = param.device_mesh.mesh_dim_names or ()
    tp_name = (tp_mesh.mesh_dim_names or ("tp",))[0]
    if tp_name not in names:  # placed by another axis (EP's experts): not TP's to check
        return False
    return isinstance(param.placements[names.index(tp_name)], Replicate)
