"""Start N fresh CPU gloo ranks for one benchmark contender and collect one result per rank (shared by the
benchmarks; imports stay outside the timed spans of the callers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def init_rank(rank: int, world: int, rendezvous: str) -> None:
    """The torchrun environment and a gloo process group for ``rank``, one intra-op thread per rank.

    The ranks meet through a file (``rendezvous``), not a TCP port: a free port picked by the parent can be taken by
    another process before rank 0 binds it, on a machine shared with other jobs.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(minutes=20)
    )


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> list[Any]:
    """Run ``target(rank, world, rendezvous, *args, results)`` on ``world`` spawned processes; return their results
    sorted by rank (each rank puts one ``(rank, result)`` on ``results``)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        rendezvous = os.path.join(directory, "rendezvous")
        processes = [
            context.Process(target=target, args=(rank, world, rendezvous, *args, results)) for rank in range(world)
        ]
        for process in processes:
            process.start()
        rows, deadline = [], time.monotonic() + timeout
        while len(rows) < world:
            try:
                rows.append(results.get(timeout=5))
            except queue.Empty:
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    for process in processes:
                        process.kill()
                    raise RuntimeError(
                        f"a benchmark rank failed (exit codes {failed}) or timed out; see its traceback above"
                    ) from None
        for process in processes:
            process.join(timeout=60)
    return [row[1] for row in sorted(rows, key=lambda row: row[0])]
