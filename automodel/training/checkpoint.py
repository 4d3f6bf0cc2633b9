"""Training checkpoints with ``torch.distributed.checkpoint``: atomic, resumed from the newest complete one,
reshardable (saved with one layout, resumed with another, pipeline-parallel or not: the keys are transformers' names).

Layout of ``checkpoint.dir``::

    step_00000010/            a complete checkpoint: DCP files (the trainable parameters and their optimizer
                              state) and trainer_state.pt
    step_00000020.partial/    being written (or left by a crash): never read, removed by the next save
    LATEST                    the name of the newest complete checkpoint (for scripts; resume also finds it without)

A checkpoint becomes visible only when rank 0 renames the finished ``.partial`` folder, after every rank wrote its
part, and then points ``LATEST`` at it (written to a temporary file and renamed over the old one), so a crash or a
kill mid-save leaves the previous checkpoint as the newest complete one.

Frozen parameters (a LoRA run's whole base model) are not saved: they are read again from the model's source on
resume, whose identity the trainer state records (``resume.py``), so a LoRA checkpoint is the adapter, its optimizer
state, the data position and the RNG.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import log_rank_zero
from automodel.loading.agreement import agree_or_raise

from .checkpoint_match import CheckpointMismatch, check_checkpoint_matches

__all__ = [
    "LATEST",
    "Checkpointer",
    "TrainerState",
    "latest_checkpoint",
    "load_checkpoint",
    "read_trainer_state",
    "save_checkpoint",
]

_COMPLETE = re.compile(r"step_(\d{8})")
_TRAINER_STATE = "trainer_state.pt"
LATEST = "LATEST"
logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """Everything besides model and optimizer that a bitwise-exact resume needs (the same on every rank)."""

    step: int
    scheduler: dict[str, Any]
    data: dict[str, Any]
    rng: torch.Tensor
    losses: list[float]
    layout: dict[str, Any] | None = None  # the layout section and world size it was saved with (for the resume log)
    base: dict[str, Any] | None = None  # the identity of the base model the frozen parameters are read from


def latest_checkpoint(directory: str | Path | None) -> Path | None:
    """The newest complete checkpoint in ``directory``, or ``None``: the folders are the truth (a ``LATEST`` file
    that a kill left behind an older name cannot send a resume back)."""
    if directory is None or not Path(directory).is_dir():
        return None
    complete = [path for path in Path(directory).iterdir() if path.is_dir() and _COMPLETE.fullmatch(path.name)]
    return max(complete, key=lambda path: int(path.name[5:]), default=None)


def save_checkpoint(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState, *, keep: int
) -> Path:
    """Write a checkpoint of ``state.step`` (collective: every rank calls it) and keep the newest ``keep``."""
    return Checkpointer(directory, keep=keep).save(model, optimizer, state)


class Checkpointer:
    """Collective: the step checkpoints of one run in ``directory``, written synchronously or, with
    ``asynchronous=True``, in the background (``torch.distributed.checkpoint.async_save``: the state is staged in
    host memory, training goes on while the files are written).

    At most one save is in flight: the next one, :meth:`wait` and :meth:`close` first finish it. A checkpoint is
    committed (renamed from ``.partial``, ``LATEST`` moved to it, old ones pruned) only after every rank finished
    writing it, so a crash or a kill during a save leaves the previous checkpoint the newest complete one. Each save
    is logged when it starts and when it is complete, with its size and place.
    """

    def __init__(self, directory: str | Path, *, keep: int, asynchronous: bool = False) -> None:
        self.directory = Path(directory)
        self.keep = keep
        # The background writes' collectives get a gloo group of their own, apart from training's.
        self._group = dist.new_group(backend="gloo") if asynchronous else None
        self._pending: _PendingSave | None = None
        self.last: Path | None = None  # the newest committed checkpoint

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState) -> Path:
        """Start (asynchronous) or write a checkpoint of ``state.step``; its final path, where it will be once
        committed."""
        self.wait()
        final = self.directory / f"step_{state.step:08d}"
        partial = final.with_name(final.name + ".partial")
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("*.partial"):
                shutil.rmtree(stale)
        dist.barrier()
        module = _state_module(model)
        model_state, optimizer_state = get_state_dict(module, optimizer, options=_FLAT_OPTIMIZER)
        model_state = _without_frozen(module, model_state)
        started = time.perf_counter()
        mode = "in the background" if self._group is not None else "synchronously"
        log_rank_zero(logger, "checkpoint of step %d: saving %s to %s", state.step, mode, final)
        if dist.get_rank() == 0:
            partial.mkdir(exist_ok=True)  # the other ranks' dcp writers may have made it already
            torch.save(vars(state), partial / _TRAINER_STATE)
        states = {"model": model_state, "optimizer": optimizer_state}
        if self._group is None:
            dcp.save(states, checkpoint_id=partial)
            self._commit(_PendingSave(None, final, started, state.step))
        else:
            future = dcp.async_save(states, checkpoint_id=partial, process_group=self._group)
            self._pending = _PendingSave(future, final, started, state.step)
            log_rank_zero(
                logger, "checkpoint of step %d: staged in %.2f s; training goes on", state.step, _since(started)
            )
        return final

    def wait(self) -> Path | None:
        """Finish the save in flight, if any, and commit it on every rank's completion; the newest committed
        checkpoint."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()
            self._commit(pending)
        return self.last

    def _commit(self, pending: _PendingSave) -> None:
        """Collective, once every rank has written its part: the checkpoint becomes complete and ``LATEST``."""
        dist.barrier()  # every rank wrote its part
        if dist.get_rank() == 0:
            partial = pending.final.with_name(pending.final.name + ".partial")
            partial.rename(pending.final)  # the commit point
            _point_latest_at(pending.final)
            complete = sorted(
                (p for p in self.directory.iterdir() if _COMPLETE.fullmatch(p.name)), key=lambda p: int(p.name[5:])
            )
            for old in complete[: -self.keep]:
                shutil.rmtree(old)
            size = sum(path.stat().st_size for path in pending.final.rglob("*") if path.is_file())
            logger.info(
                "checkpoint of step %d: complete, %.1f MiB in %.2f s: %s",
                pending.step,
                size / 2**20,
                _since(pending.started),
                pending.final,
            )
        dist.barrier()
        self.last = pending.final


@dataclass
class _PendingSave:
    future: Any  # the background save's Future; None when written synchronously
    final: Path
    started: float
    step: int


def _since(start: float) -> float:
    return time.perf_counter() - start


def _point_latest_at(checkpoint: Path) -> None:
    pointer = checkpoint.parent / LATEST
    temporary = pointer.with_name(f".{LATEST}.tmp")
    temporary.write_text(checkpoint.name + "\n")
    os.replace(temporary, pointer)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Load model and optimizer from ``path`` into the live (possibly differently sharded) objects; return the
    trainer state."""
    path = Path(path)
    module = _state_module(model)
    saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    # Checkpoints written before the optimizer state was saved flat keep its nested form.
    flat = not any(key.startswith(_NESTED_GROUPS) for key in saved)
    options = _FLAT_OPTIMIZER if flat else StateDictOptions(ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(module, optimizer, options=options)
    model_state = _without_frozen(module, model_state)
    error = None
    try:
        check_checkpoint_matches(path, module, model_state)
    except CheckpointMismatch as exc:  # raised below on every rank, before anything is read
        error = exc
    agree_or_raise(error, f"Resuming from {path}")
    never_saved = _state_never_saved(optimizer_state, saved, flat=flat)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    frozen = any(not param.requires_grad for param in module.parameters())  # not in the state: left as loaded
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=not frozen))
    # torch rebuilds a flat optimizer state from the live optimizer's keys, so the state left out of the load goes
    # back in as the fresh placeholders and is dropped once loaded; a nested one loads without it.
    optimizer_state.update(never_saved.placeholders)
    set_optimizer_state_dict(
        module,
        optimizer,
        state["optimizer"],
        options=StateDictOptions(strict=False, flatten_optimizer_state_dict=flat),
    )
    for name, parameter in module.named_parameters():
        if name in never_saved.names:
            optimizer.state.pop(parameter, None)
    return read_trainer_state(path)


def read_trainer_state(path: str | Path) -> TrainerState:
    """The trainer state of the checkpoint at ``path`` (read alone, before anything is loaded)."""
    return TrainerState(**torch.load(Path(path) / _TRAINER_STATE, weights_only=True))


def _without_frozen(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the frozen parameters ``ignore_frozen_params`` leaves in: torch drops a frozen parameter under
    its first name only, so a tied head kept a frozen embedding's weight under its own name (a LoRA checkpoint of
    SmolLM2-135M held its 113 MB). Names under a wrapper (activation checkpointing, compile) are not looked up: tied
    weights are never inside one, and torch's own option dropped their frozen parameters."""
    kept = {}
    for key, value in state.items():
        try:
            frozen = not module.get_parameter(key).requires_grad
        except AttributeError:  # a buffer, or a name under a wrapper
            frozen = False
        if not frozen:
            kept[key] = value
    return kept


def _state_module(model: nn.Module) -> nn.Module:
    """The module whose state names a checkpoint uses: transformers' names on every layout (a pipelined model's
    ``state_module()`` gives its stages' parts under them), so a checkpoint resumes with another layout."""
    return model.state_module() if isinstance(model, PipelinedModel) else model


# The optimizer state is saved flat (``state.<name>.exp_avg``, ``param_groups.<name>.lr``: keyed by parameter name,
# not by a group's index), as ranks holding different parameters need: pipeline stages' param groups would otherwise
# be saved under the same ``param_groups.0`` key with different contents. Frozen parameters are left out.
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
_OPTIMIZER_STATE = "optimizer.state."
_NESTED_GROUPS = "optimizer.param_groups.0."


@dataclass(frozen=True)
class _NeverSaved:
    names: set[str]  # the parameters whose optimizer state the checkpoint does not hold
    placeholders: dict[str, Any]  # their fresh flat entries, taken out of the state to load


def _state_never_saved(optimizer_state: dict[str, Any], saved: set[str], *, flat: bool) -> _NeverSaved:
    """Take out of the load the optimizer state of parameters that had none when the checkpoint was saved.

    ``get_state_dict`` gives a fresh optimizer state for every parameter, but a parameter that never got a gradient
    (a vision tower's final norm whose output the model does not use) had none in the saved run, which AdamW skips
    too: it keeps none after the resume, as in the uninterrupted run.
    """
    names = {key[len(_OPTIMIZER_STATE) :].rpartition(".")[0] for key in saved if key.startswith(_OPTIMIZER_STATE)}
    if not flat:
        states = optimizer_state.get("state", {})
        missing = {name for name in states if name not in names}
        for name in missing:
            del states[name]
        return _NeverSaved(missing, {})
    prefix = _OPTIMIZER_STATE.removeprefix("optimizer.")
    placeholders = {
        key: optimizer_state.pop(key)
        for key in [k for k in optimizer_state if k.startswith(prefix)]
        if key[len(prefix) :].rpartition(".")[0] not in names
    }
    return _NeverSaved({key[len(prefix) :].rpartition(".")[0] for key in placeholders}, placeholders)
