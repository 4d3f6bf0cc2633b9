"""A persistent pool of CPU gloo ranks that runs many test cases on one process group.

Starting a rank group costs seconds, so each pool starts once (spawned, not forked; a free port) and runs every case
sent to it. A case is a module-level function ``fn(*args)`` importable by the workers; each rank returns a picklable
value. When any rank fails or a case outruns its timeout, every rank's outcome is reported in one error and the pool
is torn down (a rank stuck in a collective cannot be trusted), so the next case gets a fresh group.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

STARTUP_TIMEOUT_S = 120.0
CASE_TIMEOUT_S = 300.0
GRACE_AFTER_FAILURE_S = 5.0


class RankFailure(AssertionError):
    """One or more ranks failed (or hung) while running a case."""

    def brief(self, limit: int = 3000) -> str:
        """The report cut to about ``limit`` characters for a sweep's summary: the headline and every rank's status
        line (which rank died, with what exit code, or hung), then the end of the report. A bare tail would often
        keep only a peer's "Connection closed by peer" and lose the rank that started it."""
        report = str(self)
        if len(report) <= limit:
            return report
        lines = report.splitlines()
        statuses = [lines[0], *(line for line in lines[1:] if line.startswith("--- rank "))]
        head = "\n".join(statuses)
        tail = limit - len(head)
        return f"{head}\n[...]\n{report[-tail:]}" if tail > 0 else head


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stack_file(stack_dir: str, rank: int) -> str:
    return os.path.join(stack_dir, f"rank{rank}.stacks")


def _worker(rank: int, world_size: int, port: int, stack_dir: str, tasks: mp.Queue, results: mp.Queue) -> None:
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

    # A case that outruns its timeout gets every thread's Python stack written here (SIGUSR2: the preemption handler
    # under test takes SIGUSR1) and quoted in the failure report, so a hang in CI names the collective it waits in.
    stacks = open(_stack_file(stack_dir, rank), "w")  # noqa: SIM115 - open for the worker's lifetime
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    # A rank killed by a crash in native code (a segfault in a gloo transport thread) writes every thread's Python
    # stack there too: the report then says what the rank was doing, not only its exit code.
    faulthandler.enable(file=stacks, all_threads=True)
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
        self._stack_dir = tempfile.mkdtemp(prefix="rank-pool-stacks-")
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, self.world_size, port, self._stack_dir, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        outcomes = self._collect(STARTUP_TIMEOUT_S, "start the process group")
        if len(outcomes) < self.world_size or any(status != "ready" for status, _ in outcomes.values()):
            exit_codes = {rank: process.exitcode for rank, process in enumerate(self._processes)}
            self.close()
            raise RankFailure(_describe("starting the rank group", outcomes, exit_codes, {}))

    def run(self, fn: Any, *args: Any, timeout: float = CASE_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn.__module__, fn.__qualname__, args, kwargs))
        outcomes = self._collect(timeout, fn.__qualname__)
        if len(outcomes) < self.world_size or any(status != "ok" for status, _ in outcomes.values()):
            stacks = self._stacks_of_silent_ranks(outcomes)
            exit_codes = {rank: process.exitcode for rank, process in enumerate(self._processes)}
            self.close()
            raise RankFailure(_describe(fn.__qualname__, outcomes, exit_codes, stacks))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _stacks_of_silent_ranks(self, outcomes: dict[int, tuple[str, Any]]) -> dict[int, str]:
        """Every thread's Python stack in each rank that did not answer: a live one's on SIGUSR2, a dead one's as
        faulthandler wrote it when a fatal signal ended it (none for a rank that exited)."""
        silent = [rank for rank, process in enumerate(self._processes) if rank not in outcomes and process.is_alive()]
        for rank in silent:
            os.kill(self._processes[rank].pid, signal.SIGUSR2)
        stacks: dict[int, str] = {}
        for rank, process in enumerate(self._processes):
            if rank not in outcomes and not process.is_alive():
                with open(_stack_file(self._stack_dir, rank)) as dump:
                    if text := dump.read():
                        stacks[rank] = text.rstrip()
        deadline = time.monotonic() + GRACE_AFTER_FAILURE_S
        while len(stacks) < len(silent) and time.monotonic() < deadline:
            time.sleep(0.1)
            for rank in silent:
                with open(_stack_file(self._stack_dir, rank)) as dump:
                    if text := dump.read():
                        stacks[rank] = text.rstrip()
        return stacks

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
        if self._processes:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
        self._processes = []


def _describe(
    what: str,
    outcomes: dict[int, tuple[str, Any]],
    exit_codes: dict[int, int | None],
    stacks: dict[int, str],
) -> str:
    lines = [f"{what} failed on the rank group of {len(exit_codes)}:"]
    for rank in sorted(exit_codes):
        code = exit_codes[rank]
        silent = "no answer (hung)" if code is None else f"no answer (died with exit code {code})"
        status, value = outcomes.get(rank, (silent, None))
        detail = value if status == "error" else ""
        if rank in stacks:
            detail = f"its Python stacks (faulthandler):\n{stacks[rank]}"
        lines.append(f"--- rank {rank}: {status}\n{detail}".rstrip())
    return "\n".join(lines)
