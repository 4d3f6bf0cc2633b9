"""Whether a checkpoint holds the trainable tensors of the run that resumes from it, checked before anything is read.

A checkpoint holds the trainable parameters (and persistent buffers) only. A resume whose model trains other
tensors than the run that saved it (other LoRA targets or rank, LoRA after full fine-tuning) would otherwise fail deep
in ``torch.distributed.checkpoint`` with one rank's key error, or, where the run trains fewer tensors, load what it
has and silently drop trained adapters from every later checkpoint and export. The tensors are compared by name and
global shape: each rank checks the ones it holds, and the checkpoint's tensors no rank holds are found with one
all-reduce of a flag per tensor (pipeline stages hold different tensors).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from automodel.distributed.runtime import collective_device

__all__ = ["CheckpointMismatch", "check_checkpoint_matches"]

_MODEL = "model."
_SHOWN = 5


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold the trainable tensors of the run resuming from it."""


def check_checkpoint_matches(path: Path, module: nn.Module, live_state: dict[str, torch.Tensor]) -> None:
    """Collective: raise :class:`CheckpointMismatch` on the ranks that see a difference between the trainable state of
    ``module`` (``live_state``: its state dict as the checkpoint saves it) and the model part of the checkpoint at
    ``path`` (the caller raises it on every rank)."""
    stored = {
        key[len(_MODEL) :]: tuple(entry.size)
        for key, entry in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(entry, TensorStorageMetadata)
    }
    live = {name: tuple(tensor.shape) for name, tensor in live_state.items() if isinstance(tensor, torch.Tensor)}
    # Held: a tensor of this rank's part of the model, trainable or not (checkpoints of earlier versions also held a
    # frozen embedding under its tied head's name: read, and left out of the load).
    known = set(live) | set(get_model_state_dict(module))
    order = sorted(stored)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    device = collective_device() if distributed else "cpu"
    held = torch.tensor([name in known for name in order], dtype=torch.uint8, device=device)
    if distributed:
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    problems = []
    lacking = sorted(set(live) - set(stored))
    if lacking:
        problems.append(f"it lacks {_listing(lacking)}, which this run trains")
    unheld = [name for name, flag in zip(order, held.tolist(), strict=True) if not flag]
    if unheld:
        problems.append(f"it holds {_listing(unheld)}, which this run does not train")
    reshaped = [
        f"{name} (saved {stored[name]}, now {shape})"
        for name, shape in sorted(live.items())
        if name in stored and stored[name] != shape
    ]
    if reshaped:
        problems.append(f"shapes differ: {_listing(reshaped)}")
    if problems:
        raise CheckpointMismatch(
            f"{path} was saved by a run that trains other tensors: {'; '.join(problems)}. Resume with the settings it "
            "was saved with (lora.rank, lora.target_modules, model.path, ...), or start over in another checkpoint.dir."
        )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
