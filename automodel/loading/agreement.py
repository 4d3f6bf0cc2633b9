"""Fail together: a failure any rank sees is raised on every rank, with its own exception class."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from automodel.distributed.runtime import collective_device

__all__ = ["agree_or_raise", "rebuild_exception"]


def agree_or_raise(error: BaseException | None, what: str) -> None:
    """Collective: if any rank failed ``what``, every rank raises, naming the failing ranks and their messages.

    A failure only one rank sees (its shard file unreadable, say) would otherwise leave the others waiting in the
    next collective. Every rank raises the exception class of the lowest failing rank (``FileNotFoundError``,
    ``ValueError``, ...), so ``except`` clauses catch the same thing on 1 rank and on N; a failing rank chains its own
    exception as the cause. Without a process group (or with one rank) the error itself is raised.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    # One small reduction on the common path; the messages are gathered only when some rank failed.
    any_failed = torch.tensor([0 if error is None else 1], device=collective_device())
    dist.all_reduce(any_failed, op=dist.ReduceOp.MAX)
    if not any_failed.item():
        return
    reports: list[tuple[str, str, str] | None] = [None] * dist.get_world_size()
    mine = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    dist.all_gather_object(reports, mine)
    failed = {rank: report for rank, report in enumerate(reports) if report is not None}
    details = _grouped(failed)
    module, qualname, _ = failed[min(failed)]
    combined = rebuild_exception(
        module, qualname, f"{what} failed on {len(failed)} of {len(reports)} ranks:\n{details}"
    )
    if error is not None:
        raise combined from error
    raise combined


def _grouped(failed: dict[int, tuple[str, str, str]]) -> str:
    """One line per distinct failure, naming the ranks that saw it (the same message from 1,000 ranks is one line)."""
    ranks_by_report: dict[tuple[str, str], list[int]] = {}
    for rank, (_, name, message) in sorted(failed.items()):
        ranks_by_report.setdefault((name, message), []).append(rank)
    lines = []
    for (name, message), ranks in ranks_by_report.items():
        shown = ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}-{ranks[-1]} ({len(ranks)} ranks)"
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {shown}: {name}: {message}")
    return "\n".join(lines)


def rebuild_exception(module: str, qualname: str, message: str) -> Exception:
    """An exception of the class ``module.qualname`` carrying ``message``.

    A class that cannot be imported here, or whose constructor does not take a single message, is stood in for by a
    subclass of the nearest class that can (``isinstance`` and ``except`` still match), else a ``RuntimeError``.
    """
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError):
        cls = RuntimeError
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    try:
        rebuilt = cls(message)
        if str(rebuilt) == message:
            return rebuilt
    except Exception:  # a constructor with other required arguments: stand in below
        pass
    stand_in = type(cls.__name__, (cls,), {"__init__": Exception.__init__, "__str__": Exception.__str__})
    stand_in.__module__ = cls.__module__
    stand_in.__qualname__ = cls.__qualname__
    return stand_in(message)
