"""A watchdog for hung runs: if no training step completes within ``train.hang_timeout_s``, every rank dumps every
thread's Python stack (``faulthandler``) to its log, says in one line where its training thread waits (the
``torch.distributed`` call, and the project or user frame that made it), and the process exits with
:data:`HANG_EXIT_STATUS`, so torchrun ends (or restarts) the job instead of it waiting forever.

Each rank's watchdog fires on its own: a hung collective cannot be used to agree, so every rank reports for itself
(the rank that stopped participating says where it is, the others that they wait in a collective).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from types import FrameType

__all__ = ["HANG_EXIT_STATUS", "HangWatchdog"]

HANG_EXIT_STATUS = 124  # timeout(1)'s status for "timed out"


class HangWatchdog:
    """Entered around the training loop; :meth:`beat` after each step. ``timeout_s=0``: no watchdog."""

    def __init__(self, timeout_s: float, *, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.step = 0
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._watched = threading.main_thread()
        self._thread = threading.Thread(target=self._watch, name="automodel-hang-watchdog", daemon=True)

    def __enter__(self) -> HangWatchdog:
        self._watched = threading.current_thread()
        self._last = time.monotonic()
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def beat(self, step: int) -> None:
        """Step ``step`` completed."""
        self.step = step
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(self.timeout_s, 5.0)):
            if time.monotonic() - self._last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        waited = time.monotonic() - self._last
        print(f"rank {self.rank}: every thread's stack, {waited:.0f} s after the last completed step:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        frame = sys._current_frames().get(self._watched.ident)
        print(
            f"automodel: rank {self.rank}: no training step completed in {waited:.0f} s (train.hang_timeout_s="
            f"{self.timeout_s:g}) after step {self.step}; {where_it_waits(frame)}. Exiting with status "
            f"{HANG_EXIT_STATUS}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HANG_EXIT_STATUS)


def where_it_waits(frame: FrameType | None) -> str:
    """``waiting in torch.distributed's all_reduce, called from automodel/training/loop.py:412 (_step_facts)``, or
    the innermost frame outside torch where no collective is running."""
    if frame is None:
        return "its training thread is gone"
    stack = traceback.extract_stack(frame)
    distributed = [e for e in stack if "/torch/distributed/" in e.filename.replace(os.sep, "/") and e.name != "wrapper"]
    ours = [entry for entry in stack if "/torch/" not in entry.filename.replace(os.sep, "/")]
    caller = ours[-1] if ours else stack[-1]
    place = f"{_short(caller.filename)}:{caller.lineno} ({caller.name})"
    if distributed:  # the outermost torch.distributed call is the collective the caller made
        return f"waiting in torch.distributed's {distributed[0].name}, called from {place}"
    return f"busy outside any collective, at {place}"


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("automodel", "model_sidecars", "tests"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
    return path
