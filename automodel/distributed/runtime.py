"""Where this process stands in a run: whether it is rank 0, the device it computes on, and the whole value of a
sharded tensor. One home for each, shared by the parallelizer, the loader, the auto classes and the training code."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel._compat.torch import full_tensor as compat_full_tensor

if TYPE_CHECKING:
    from .mesh import MeshContext

__all__ = [
    "PROGRESS_BARS_VARIABLE",
    "collective_device",
    "device_of",
    "full_tensor",
    "is_rank_zero",
    "log_rank_zero",
    "progress_bars_disabled",
    "rank",
    "world_size",
]

#: Set to 1 by the ``automodel`` command when its own output is a terminal: its training processes write into a pipe
#: (``automodel.training.run_log``), which passes their bars on to that terminal.
PROGRESS_BARS_VARIABLE = "AUTOMODEL_PROGRESS_BARS"


def progress_bars_disabled() -> bool | None:
    """tqdm's ``disable``: bars on a terminal only (``None``: tqdm asks whether the output is one), or where the
    ``automodel`` command says that its output, which this process writes through, is one. In a log file a bar's
    carriage-return redraws would glue onto the next lines."""
    return False if os.environ.get(PROGRESS_BARS_VARIABLE) == "1" else None


def rank() -> int:
    """This process's rank in the default process group; 0 in a process without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The default process group's size; 1 in a process without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank_zero() -> bool:
    """True on rank 0 of the default process group, and in a process without one."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def log_rank_zero(logger: logging.Logger, message: str, *args: Any, level: int = logging.INFO) -> None:
    """``logger.log(level, message, *args)`` on rank 0 only (every rank would print the same line)."""
    if is_rank_zero():
        logger.log(level, message, *args)


def collective_device() -> torch.device:
    """The device whose tensors the default process group's collectives take: the CPU under gloo (or MPI) and under
    torch's fake process group (a simulated rank, see ``automodel.plan``: no device is touched), else the current
    accelerator (NCCL, or a ``cpu:gloo,cuda:nccl`` pair). Meshes are built on its type."""
    backend = str(dist.get_backend()).lower()
    # check_available: a CUDA build of torch on a machine without a driver has no accelerator.
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if backend in ("gloo", "mpi", "fake") or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def device_of(mesh_context: MeshContext | None) -> torch.device:
    """The device this rank's shards live on: the current CUDA device under NCCL, else the CPU (also without a
    context)."""
    if mesh_context is not None and mesh_context.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of ``tensor``: gathered when it is a ``DTensor`` (collective: every rank of its mesh must
    call it), else the tensor itself."""
    return compat_full_tensor(tensor) if isinstance(tensor, DTensor) else tensor
