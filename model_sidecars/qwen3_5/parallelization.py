"""Model-owned FSDP grouping for Qwen3.5: every FSDP unit holds parameters of one dtype.

The sidecar model class keeps GatedDeltaNet's ``A_log`` / ``dt_bias`` / norm weight fp32 beside bf16 weights, and
FSDP2 refuses a unit that mixes dtypes. The default units (one per decoder layer) would mix them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from automodel.distributed import ModelParallelizer, fully_shard_by_dtype, shard_default_units

__all__ = ["PARALLELIZER"]


def _mixed_dtype_owners(layer: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Submodules of ``layer`` that own parameters of one dtype directly while some children hold another, each with
    those children (GatedDeltaNet: fp32 ``A_log`` / ``dt_bias`` directly, bf16 projections and conv below)."""
    owners = []
    # Modules already inside an FSDP unit (the layers' groups, when the root is sharded) are done.
    sharded = {
        id(inner)
        for sub in layer.modules()
        if sub is not layer and isinstance(sub, FSDPModule)
        for inner in sub.modules()
    }
    for module in layer.modules():
        own = {param.dtype for param in module.parameters(recurse=False)}
        if module is layer or id(module) in sharded or len(own) != 1:
            continue
        others = [child for child in module.children() if any(p.dtype not in own for p in child.parameters())]
        if others:
            owners.append((module, others))
    return owners


def _shard_mixed_dtype_owners(layer: nn.Module, shard: Callable[..., nn.Module], **kwargs: Any) -> None:
    """Give each mixed-dtype owner's other-dtype children one unit together, then the owner its own.

    ``fully_shard_by_dtype`` alone would shard the owner with its children in one (mixed) unit. The children form one
    group rather than a unit each because GatedDeltaNet reads ``conv1d.weight`` without calling ``conv1d``: the group
    is gathered when its first member (the QKV projection, which runs before the convolution) runs. An fp32 owner
    (``A_log``, ``dt_bias``, the gated norm) also computes in fp32 under a bf16 mixed-precision policy: keeping them
    fp32 is for the precision of the decay and the norm, which a bf16 all-gather would round away.
    """
    for owner, others in _mixed_dtype_owners(layer):
        shard(others, **kwargs)
        shard(owner, **{**kwargs, "mp_policy": _fp32_compute(kwargs.get("mp_policy"), owner)})


def _fp32_compute(policy: MixedPrecisionPolicy | None, owner: nn.Module) -> MixedPrecisionPolicy | None:
    """``policy`` with fp32 parameters for an owner whose own parameters are fp32; inputs are not cast (the unit sits
    inside a bf16 layer and hands the activations back in their own dtype, as the model does without FSDP)."""
    own = {param.dtype for param in owner.parameters(recurse=False)}
    if policy is None or own != {torch.float32}:
        return policy
    return dataclasses.replace(policy, param_dtype=torch.float32, cast_forward_inputs=False)


class Qwen3_5ModelParallelizer(ModelParallelizer):
    """Qwen3.5's parallelization: the shared flow with dtype-uniform FSDP units."""

    def _apply_fsdp_sharding(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | None = None,
    ) -> nn.Module:
        """The shared unit boundaries (decoder layers, embeddings, head, root), each split into dtype groups."""
        return shard_default_units(
            model,
            functools.partial(_shard_by_dtype, shard=self._fully_shard_module),
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )


def _shard_by_dtype(unit: nn.Module, *, shard: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """Mixed-dtype owners inside ``unit`` first (GatedDeltaNet in a decoder layer), then ``fully_shard_by_dtype``."""
    _shard_mixed_dtype_owners(unit, shard, **kwargs)
    return fully_shard_by_dtype(unit, shard, **kwargs)


PARALLELIZER = Qwen3_5ModelParallelizer()
