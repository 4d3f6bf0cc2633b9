"""Cases that misbehave on purpose, for the rank pool's own failure reports."""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def stall_on_rank_one() -> int:
    """Rank 1 sleeps past the case's timeout (as a rank stuck in a collective would); the others answer."""
    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def exit_on_rank_one() -> int:
    """Rank 1 dies with exit code 3 (as a rank killed mid-case would); the others answer."""
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def crash_on_rank_one() -> int:
    """Rank 1 dies of a segmentation fault (as a crash in native code would); the others answer."""
    if dist.get_rank() == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return dist.get_rank()
