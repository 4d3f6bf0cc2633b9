"""Preemption: a scheduler's SIGTERM or SIGUSR1, or a user's Ctrl-C (SIGINT), ends the run at the next step boundary
with a complete checkpoint.

Any process may get the signal: the ``automodel`` command (it forwards it to the training processes), torchrun (it
forwards it to its workers), or a single rank. The signal only sets a flag; the ranks agree on it after every step
(one all-reduce of a flag), save a checkpoint together and end with status 0.

Rank 0 says what a signal does, once for the job (every process gets a Ctrl-C). Schedulers often deliver one notice
several times: SLURM signals every process of the job step, and the launcher forwards it too. Signals within
``DUPLICATE_WINDOW_S`` of the first are that same notice. A signal after that stops the process at once: a save it
interrupts never becomes visible (see ``automodel.training.checkpoint``), so the previous complete checkpoint stays the
newest.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

__all__ = [
    "DUPLICATE_WINDOW_S",
    "PREEMPTION_SIGNALS",
    "PreemptionHandler",
    "forward_signals",
    "describe",
    "launcher_settings",
    "restore_default_handlers",
]

# Ctrl-C reaches every process of the terminal's foreground group at once (the command, torchrun, the workers): the
# workers save, torchrun ignores it (``launcher_settings``) and the command forwards it, a copy the workers ignore.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Copies of one notice (from the scheduler, torchrun and the command) arrive within milliseconds of each other.
DUPLICATE_WINDOW_S = 2.0


class PreemptionHandler:
    """Installs the signal handlers for the run (``with PreemptionHandler() as preemption:``) and restores the old
    ones after."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> PreemptionHandler:
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = describe(signal.Signals(signum))
        if self.received is not None:
            if time.monotonic() - self._received_at < DUPLICATE_WINDOW_S:
                return  # the same notice again, by another route
            _say(f"automodel: second {name}: stopping now, without a checkpoint\n")
            os._exit(128 + signum)
        self.received = signal.Signals(signum)
        self._received_at = time.monotonic()
        again = "; press Ctrl-C again to stop without saving" if signum == signal.SIGINT else ""
        _say(f"automodel: {name} received: saving a checkpoint after this step, then exiting{again}\n")

    def agreed(self, device: torch.device) -> bool:
        """Collective: whether any rank got a signal (the same answer on every rank)."""
        flag = torch.tensor([0 if self.received is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _say(line: str) -> None:
    """Write ``line`` to stderr from rank 0 (or a process outside a job): a Ctrl-C reaches every process of the job at
    once, and one line says what it does. The other ranks act on it in silence."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, line.encode())


def describe(signum: signal.Signals) -> str:
    """How the messages name a signal: ``Ctrl-C`` for SIGINT, else its name."""
    return "Ctrl-C" if signum == signal.SIGINT else signum.name


def forward_signals(child_pid: int, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> list[signal.Signals]:
    """In the launching command: pass each of ``signals`` on to the training processes (the children of the
    torchrun process ``child_pid``), so that they save and end normally and torchrun, seeing clean exits, ends with
    status 0. Where the children cannot be listed (no ``/proc``), the signal goes to torchrun, which forwards it.
    Returns the list the signals received are appended to (the command's exit status says a Ctrl-C)."""
    received: list[signal.Signals] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum))
        targets = _children(child_pid) or [child_pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for signum in signals:
        signal.signal(signum, handle)
    return received


def launcher_settings() -> tuple[list[str], Callable[[], None] | None]:
    """The torchrun options and ``preexec_fn`` for the torchrun that ``forward_signals`` serves: torchrun leaves
    SIGTERM and SIGUSR1 to the command. By default it would answer SIGTERM by killing its workers 30 s later, whatever
    they are saving, and die on SIGUSR1. Where the workers cannot be listed, torchrun keeps its own handling."""
    if not sys.platform.startswith("linux"):
        return [], None

    def ignore_preemption_signals() -> None:
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    return ["--signals-to-handle=SIGHUP,SIGQUIT"], ignore_preemption_signals


def restore_default_handlers() -> None:
    """In a training process: the default actions back (``launcher_settings`` made the launcher ignore the signals,
    and its children inherit that) until the run installs its ``PreemptionHandler``: Python's ``KeyboardInterrupt``
    for SIGINT."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``), or ``[]``."""
    if not sys.platform.startswith("linux"):
        return []
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # fields after the command: state, ppid, ...
            children.append(int(entry))
    return children
