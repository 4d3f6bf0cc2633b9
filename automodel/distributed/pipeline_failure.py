"""What a pipeline rank does when its part of a schedule step raises: it says where, and it ends.

torch's schedules have no agreement step, and one after each step could not help: the other stages' ranks wait for
this rank's activations or gradients in a receive, and never reach it. Aborting the process groups does not reach them
either: on gloo (torch 2.11 - 2.14) ``abort()`` and ``shutdown()`` leave the connections open, and a peer blocked in a
receive woke only when the failing process ended (measured: 17-22 s after the abort, at the process's exit). What does
reach every peer at once is the end of the failing process: its connections close, each pending receive or collective
fails with "Connection closed by peer", and torchrun, seeing a worker end with an error, stops the rest of the group.
So a failed step is not caught here: it costs nothing per step (a ``try`` block) and the error propagates out of the
process, wrapped once so that it names where it arose.

Every rank raises :class:`StageFailure`, naming its stage, its rank and the innermost module of its stages that was
running (for the rank where the error arose; a peer that failed in a receive names none), with the original error as
its cause. A caller that catches it must end the process: the stages are left mid-schedule.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

__all__ = ["StageFailure", "ending_every_stage_on_failure"]

_MESSAGE_LINES = 3


class StageFailure(RuntimeError):
    """A pipeline step failed on this rank; ``failed_at`` is when (``time.time()``), taken as the error reached the
    step, so the rank where it began is earlier than its peers (which fail once it has ended) in a failure summary."""

    def __init__(self, message: str, failed_at: float) -> None:
        super().__init__(message)
        self.failed_at = failed_at


@contextlib.contextmanager
def ending_every_stage_on_failure(stages: list[nn.Module], stage_indices: list[int], num_stages: int) -> Iterator[None]:
    """Run a schedule step; if it raises an ``Exception``, raise :class:`StageFailure` from it (a
    ``KeyboardInterrupt`` or ``SystemExit`` passes as it is)."""
    try:
        yield
    except Exception as error:
        raise StageFailure(_describe(error, stages, stage_indices, num_stages), time.time()) from error


def _describe(error: BaseException, stages: list[nn.Module], stage_indices: list[int], num_stages: int) -> str:
    """``"pipeline stage 1 of 2 (rank 3) failed in model.layers.1.mlp (LlamaMLP): ValueError: ..."``."""
    origin = _innermost_cause(error)
    found = _innermost_module(origin, stages)
    if found is None:
        where = "outside its modules' forwards (in the schedule's sends, receives or backward)"
        index = stage_indices[0]
    else:
        position, name, module = found
        where = f"in {name or 'the stage module'} ({type(module).__name__})"
        index = stage_indices[position]
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = str(origin).strip().splitlines() or [""]
    if len(lines) > _MESSAGE_LINES:
        lines = [*lines[:_MESSAGE_LINES], f"... ({len(lines) - _MESSAGE_LINES} more lines)"]
    text = "\n".join(lines)
    return (
        f"pipeline stage {index} of {num_stages} (rank {rank}) failed {where}: {type(origin).__name__}: {text}\n"
        "(the stages are left mid-schedule: the run cannot continue; end this process, and torchrun ends the others)"
    )


def _innermost_cause(error: BaseException) -> BaseException:
    """The error at the end of the ``raise ... from`` chain: torch's stage re-raises a forward's error as a
    ``RuntimeError`` listing the arguments' shapes, from the error itself."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def _innermost_module(error: BaseException, stages: list[nn.Module]) -> tuple[int, str, nn.Module] | None:
    """(stage position, qualified name, module) of the innermost frame of ``error``'s traceback whose ``self`` is a
    module of one of ``stages``; ``None`` when none is (the frames are read only now, on failure)."""
    names = {
        id(module): (position, name, module)
        for position, stage in enumerate(stages)
        for name, module in stage.named_modules()
    }
    found = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
    return found
