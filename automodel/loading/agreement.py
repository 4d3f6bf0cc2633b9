"""Fail together: a failure any rank sees is raised on every rank."""

from __future__ import annotations

import torch.distributed as dist

from .checkpoint_files import CheckpointError

__all__ = ["agree_or_raise"]


def agree_or_raise(error: BaseException | None, what: str) -> None:
    """Collective: if any rank failed ``what``, every rank raises, naming the failing ranks and their messages.

    A failure only one rank sees (its shard file unreadable, say) would otherwise leave the others waiting in the
    next collective.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    failed = {rank: message for rank, message in enumerate(messages) if message is not None}
    if not failed:
        return
    details = "\n".join(f"  rank {rank}: {message}" for rank, message in sorted(failed.items()))
    combined = CheckpointError(f"{what} failed on {len(failed)} of {len(messages)} ranks:\n{details}")
    if error is not None:
        raise combined from error
    raise combined
