"""The shared DDP path: every rank holds the whole model; gradients are all-reduced over ``dp``."""

from __future__ import annotations

from torch import nn

from automodel._compat.torch import replicate

from .config import DDPConfig
from .mesh import MeshContext

__all__ = ["apply_ddp"]


def apply_ddp(model: nn.Module, context: MeshContext) -> nn.Module:
    """Replicate ``model`` (already checkpointed by the caller) over the ``dp`` mesh with torch's composable DDP (``replicate``).

    The composable form keeps the model's own class (``generate``, ``config``, ``save_pretrained`` stay), unlike
    wrapping it in ``DistributedDataParallel``. DDP initialises lazily on the first forward, so weights loaded after
    this call are the ones broadcast and kept in sync.
    """
    config = context.strategy
    assert isinstance(config, DDPConfig), f"apply_ddp needs a DDPConfig, got {type(config).__name__}"
    return replicate(
        model,
        device_mesh=context.mesh("dp"),
        bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
