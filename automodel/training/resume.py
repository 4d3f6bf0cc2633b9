"""Resuming a run from its newest checkpoint, and the trainer state each checkpoint records.

A checkpoint holds what training changes: the trainable parameters, their optimizer state, the data position, the
RNG, the schedule and the losses (``checkpoint.py``). With frozen parameters (LoRA: the whole base model) those are
read again from ``model.path`` on resume, so the checkpoint records the base's identity and a resume on another base
is refused on every rank (``base_identity.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from automodel.distributed.runtime import log_rank_zero
from automodel.loading.agreement import agree_or_raise

from .base_identity import BaseChanged, base_identity, check_base_identity
from .checkpoint import TrainerState, latest_checkpoint, load_checkpoint, read_trainer_state
from .config import RecipeConfig
from .optim import resume_schedule

__all__ = ["frozen_base_identity", "resume_if_saved", "trainer_state"]

logger = logging.getLogger("automodel.training")


def frozen_base_identity(config: RecipeConfig, model: nn.Module) -> dict[str, Any] | None:
    """The identity of the base model a run reads its frozen parameters from (``model.path``), when it has any and
    they come from a checkpoint (SFT); ``None`` otherwise (every parameter is in the checkpoints)."""
    if config.recipe != "sft" or all(param.requires_grad for param in model.parameters()):
        return None
    from automodel.loading.hub import HubOptions, resolve_config_dir

    model_config = config.model
    options = HubOptions(revision=model_config.revision, trust_remote_code=model_config.trust_remote_code)
    directory = resolve_config_dir(model_config.path, options)
    return base_identity(model_config.path, directory, model_config.revision)


def trainer_state(
    config: RecipeConfig, step: int, scheduler: Any, loader: Any, losses: list[float], base: dict[str, Any] | None
) -> TrainerState:
    """What a checkpoint of ``step`` records besides the trainable parameters and their optimizer state."""
    return TrainerState(
        step, scheduler.state_dict(), loader.state_dict(), torch.get_rng_state(), losses, layout_of(config), base
    )


def resume_if_saved(
    config: RecipeConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Any,
    base: dict[str, Any] | None,
) -> TrainerState | None:
    """Collective: load the newest complete checkpoint of ``checkpoint.dir`` into the live objects (model, optimizer,
    schedule, data position, RNG) and return its state; ``None`` when there is none. A checkpoint whose base model is
    not ``base`` (the run's, :func:`frozen_base_identity`) is refused on every rank before anything is loaded."""
    resume = latest_checkpoint(config.checkpoint.dir)
    _log_restart(resume)
    if resume is None:
        return None
    moved, error = None, None
    try:
        saved = _readable(resume, read_trainer_state)
        _check_within_max_steps(saved.step, config.train.max_steps, resume)
        moved = _check_base(saved.base, base, resume)
    except (BaseChanged, ValueError, RuntimeError) as exc:  # raised below on every rank
        error = exc
    agree_or_raise(error, f"Resuming from {resume}")
    if moved:
        log_rank_zero(logger, "%s", moved)
    state = _readable(resume, lambda path: load_checkpoint(path, model, optimizer))
    lr = resume_schedule(optimizer, scheduler, config.train, state.step)
    loader.load_state_dict(state.data)
    torch.set_rng_state(state.rng)
    saved_seed = state.data.get("seed") if isinstance(state.data, dict) else None
    if saved_seed is not None and saved_seed != config.data.seed:
        log_rank_zero(
            logger,
            "data.seed=%d is not the checkpoint's (%d): the resumed run keeps the checkpoint's data order (start over "
            "in another checkpoint.dir for another order)",
            config.data.seed,
            saved_seed,
        )
    log_rank_zero(
        logger,
        "resuming from %s at step %d (layout saved: %s, layout now: %s); learning rate %.3e from this config's schedule",
        resume,
        state.step,
        _describe_layout(state.layout),
        _describe_layout(layout_of(config)),
        lr,
    )
    return state


def _check_within_max_steps(step: int, max_steps: int, checkpoint: Path) -> None:
    if step > max_steps:
        raise ValueError(
            f"{checkpoint} is at step {step}, past train.max_steps={max_steps}: nothing is left to train, and an export "
            f"would hold {step} steps' weights. Raise train.max_steps to go on, or start over in another checkpoint.dir."
        )


def _readable(checkpoint: Path, read: Any) -> Any:
    """``read(checkpoint)``; a checkpoint that cannot be read (a file truncated or deleted after it was written) is
    an error naming it and the way past it: the checkpoint before it."""
    try:
        return read(checkpoint)
    except (OSError, RuntimeError, EOFError, CheckpointException) as error:
        earlier = sorted(path.name for path in checkpoint.parent.glob("step_*") if path.is_dir() and path < checkpoint)
        fallback = f" to resume from {earlier[-1]}" if earlier else " to start over"
        raise RuntimeError(
            f"{checkpoint} cannot be read ({type(error).__name__}: {error}). If it is damaged, move it out of "
            f"{checkpoint.parent}{fallback}."
        ) from error


def _check_base(saved: dict[str, Any] | None, now: dict[str, Any] | None, checkpoint: Path) -> str | None:
    if saved is not None and now is None:
        raise BaseChanged(
            f"{checkpoint} holds only the trainable parameters of a run with a frozen base (LoRA), but this run "
            "trains every parameter: resume it with the same lora settings, or start over in another checkpoint.dir."
        )
    if saved is None or now is None:
        return None  # every parameter is in the checkpoint (or, written before bases were recorded, it holds the base)
    return check_base_identity(saved, now, checkpoint)


def layout_of(config: RecipeConfig) -> dict[str, Any]:
    """What the resume log compares: the layout section and the number of processes."""
    return {**config.to_dict()["layout"], "world_size": dist.get_world_size()}


def _describe_layout(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "not recorded"
    defaults = {"pp_size": 1, "dp_replicate_size": 1, "tp_size": 1, "cp_size": 1, "ep_size": 1}
    count = layout.get("world_size")
    shown = [f"{layout.get('strategy')} on {count} process{'' if count == 1 else 'es'}"]
    shown += [f"{key}={value}" for key, value in layout.items() if key in defaults and value != defaults[key]]
    shown += [key for key in ("sequence_parallel",) if layout.get(key)]
    return ", ".join(shown)


def _log_restart(resume: Path | None) -> None:
    """Under torchrun's restarts (``--max-restarts``), say which restart this is and where it resumes."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0:
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        where = f"resuming from {resume}" if resume is not None else "no checkpoint to resume from, starting over"
        log_rank_zero(logger, "restart %d of %s: %s", restart, limit, where)
