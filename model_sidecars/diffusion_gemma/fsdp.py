"""The FSDP2 primitive of the DiffusionGemma sidecar: routed experts first, then the layer around them.

DiffusionGemma's encoder layer ``i`` and decoder layer ``i`` hold the same parameters (transformers ties them), and
FSDP2 can only shard a parameter in one unit, so a unit here is a group of such twin layers (``fully_shard`` of a
list). The experts of the twins form one unit of their own before it, which keeps the largest tensors of a layer
in a separate all-gather and lets them be resharded as soon as the experts have run. On the MoE path the experts
arrive as units already (EP owns them, sharded over ``ep_shard``), and only the layers are left to shard.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from automodel.distributed import fully_shard_default

__all__: list[str] = []

Modules = nn.Module | list[nn.Module]


def _fully_shard_experts_first(modules: Modules, **kwargs: Any) -> Modules:
    """Shard the routed experts of ``modules`` (one layer, or twin layers sharing parameters) as one unit, unless
    they are units already, then ``modules`` as the unit around them. A module without ``experts`` is sharded as it
    is."""
    layers = modules if isinstance(modules, list) else [modules]
    experts = [
        layer.experts
        for layer in layers
        if isinstance(getattr(layer, "experts", None), nn.Module) and not isinstance(layer.experts, FSDPModule)
    ]
    if experts:
        fully_shard_default(_one_or_group(experts), **kwargs)
    return fully_shard_default(_one_or_group(layers), **kwargs)


def _one_or_group(modules: list[nn.Module]) -> Modules:
    return modules[0] if len(modules) == 1 else modules
