"""A persistent pool of CPU gloo ranks that runs many test cases on one process group.

Starting a rank group costs seconds, so each pool starts once (spawned, not forked; a free port) and runs every case
sent to it. A case is a module-level function ``fn(*args)`` importable by the workers; each rank returns a picklable
value. When any rank fails or a case outruns its timeout, every rank's outcome is reported in one error and the pool
is torn down (a rank stuck in a collective cannot be trusted), so the next case gets a fresh group.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

STARTUP_TIMEOUT_S = 120.0
CASE_TIMEOUT_S = 300.0
GRACE_AFTER_FAILURE_S = 5.0


class RankFailure(AssertionError):
    """One or more ranks failed (or hung) while running a case."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=CASE_TIMEOUT_S))
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (task := tasks.get()) is not None:
        module_name, qualname, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module_name), qualname)
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned gloo ranks; ``run(fn, *args)`` executes ``fn`` on all of them and returns their results."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._processes: list[mp.Process] = []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._processes = [
            context.Process(
                target=_worker, args=(rank, self.world_size, port, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        outcomes = self._collect(STARTUP_TIMEOUT_S, "start the process group")
        if any(status != "ready" for status, _ in outcomes.values()):
            self.close()
            raise RankFailure(_describe("starting the rank group", outcomes, self.world_size))

    def run(self, fn: Any, *args: Any, timeout: float = CASE_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn.__module__, fn.__qualname__, args, kwargs))
        outcomes = self._collect(timeout, fn.__qualname__)
        if len(outcomes) < self.world_size or any(status != "ok" for status, _ in outcomes.values()):
            self.close()
            raise RankFailure(_describe(fn.__qualname__, outcomes, self.world_size))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            if any(status == "error" for status, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in self._processes if not p.is_alive()]
                if dead and not any(status == "error" for status, _ in outcomes.values()):
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                continue
            outcomes[rank] = (status, value)
        return outcomes

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for tasks, process in zip(self._tasks if self._processes else [], self._processes, strict=False):
            if process.is_alive():
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []


def _describe(what: str, outcomes: dict[int, tuple[str, Any]], world_size: int) -> str:
    lines = [f"{what} failed on the rank group of {world_size}:"]
    for rank in range(world_size):
        status, value = outcomes.get(rank, ("no answer (hung or died)", None))
        detail = value if status == "error" else ""
        lines.append(f"--- rank {rank}: {status}\n{detail}".rstrip())
    return "\n".join(lines)
