"""Which path honours which sidecar hook, checked before anything is touched.

Every protected hook runs on every path it can apply to (see ``docs/model-parallelizer.md``, "Hooks on every path").
Where a path cannot apply an override, ``parallelize`` raises at once, naming the hook, the sidecar and the path; where
a hook has nothing to act on (FSDP unit hooks under DDP, which has no units), rank 0 logs that it does not apply. A
hook is never skipped silently.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .config import DDPConfig, FSDP2Config, MegatronFSDPConfig
from .runtime import log_rank_zero

if TYPE_CHECKING:
    from .mesh import MeshContext
    from .parallelizer import ModelParallelizer

__all__ = ["FSDP_HOOKS", "check_hooks", "overrides", "path_name"]

logger = logging.getLogger(__name__)

#: The hooks that decide FSDP2 units and how each is sharded.
FSDP_HOOKS = ("_apply_fsdp_sharding", "_fully_shard_module")


def overrides(parallelizer: ModelParallelizer, hook: str) -> bool:
    """Whether ``parallelizer``'s class (or the instance itself) replaces the shared ``hook``."""
    from .parallelizer import ModelParallelizer

    if hook in vars(parallelizer):
        return True
    return getattr(type(parallelizer), hook) is not getattr(ModelParallelizer, hook)


def path_name(context: MeshContext) -> str:
    """The dispatch path ``context`` selects, as the errors and logs name it."""
    strategy = context.strategy
    if context.ep_size > 1:
        return f"the unified MoE path (ep_size={context.ep_size})"
    if isinstance(strategy, FSDP2Config):
        return "the dense FSDP2 path"
    if isinstance(strategy, DDPConfig):
        return "the DDP path"
    return "the Megatron-FSDP path"


def check_hooks(parallelizer: ModelParallelizer, context: MeshContext) -> None:
    """Raise when the path ``context`` selects cannot apply one of ``parallelizer``'s overridden hooks."""
    sidecar = type(parallelizer).__name__
    path = path_name(context)
    overridden = [hook for hook in FSDP_HOOKS if overrides(parallelizer, hook)]
    if not overridden:
        return
    strategy = context.strategy
    if isinstance(strategy, MegatronFSDPConfig):
        raise ValueError(
            f"{sidecar} overrides {_listing(overridden)} (how the model is cut into FSDP2 units and sharded); {path} "
            "shards by unit classes with its own primitive and cannot apply that. Use strategy='fsdp2' for this model."
        )
    if isinstance(strategy, DDPConfig):
        log_rank_zero(
            logger,
            "%s: %s of %s do not apply (DDP keeps the whole model on every rank: there are no FSDP units).",
            path,
            _listing(overridden),
            sidecar,
        )
        return
    if context.ep_size == 1 or parallelizer._customizes_moe_fsdp or "_fully_shard_module" not in overridden:
        return
    if "_apply_fsdp_sharding" in overridden:
        raise ValueError(
            f"{sidecar} overrides `_apply_fsdp_sharding` and `_fully_shard_module` but keeps "
            f"`_customizes_moe_fsdp = False`, so on {path} its units would have to be sharded without its primitive. "
            "Set `_customizes_moe_fsdp = True` if the primitive is safe once EP owns the experts (experts modules "
            "arrive already sharded over ep_shard), or use ep_size=1."
        )
    log_rank_zero(
        logger,
        "%s: %s keeps `_customizes_moe_fsdp = False`, so its `_fully_shard_module` is not used there; the units are "
        "sharded with the shared fully_shard.",
        path,
        sidecar,
    )


def _listing(hooks: list[str]) -> str:
    return " and ".join(f"`{hook}`" for hook in hooks)
