"""AdamW, the warmup + cosine schedule, and gradient clipping that is correct for sharded (DTensor) gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from automodel._compat.torch import set_last_lr
from automodel.distributed.grad_clipping import clip_grad_norm_, total_grad_norm

from .config import TrainSection

__all__ = ["clip_grad_norm", "grad_norm", "make_optimizer", "make_scheduler", "resume_schedule"]


def make_optimizer(model: nn.Module, train: TrainSection) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms, biases and other 1-D parameters get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    # A rank may hold no trainable parameter (a pipeline stage without LoRA adapters): torch refuses an optimizer
    # without parameter groups, not one whose group is empty, and the rank still takes part in every step.
    groups = [group for group in groups if group["params"]] or groups[:1]
    # foreach=False: the per-parameter loop treats DTensors on different meshes (TP, FSDP, EP) alike.
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, foreach=False)


def make_scheduler(optimizer: torch.optim.Optimizer, train: TrainSection) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` from ``lr / warmup_steps``, then cosine decay to ``min_lr`` at
    ``max_steps``."""
    floor = train.min_lr / train.lr

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        decay_steps = max(1, train.max_steps - train.warmup_steps)
        progress = min(1.0, (step - train.warmup_steps) / decay_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_schedule(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, train: TrainSection, step: int
) -> float:
    """Continue at ``step`` on the schedule and hyperparameters of the current config, whatever the checkpoint's
    were: a resumed run with another ``max_steps``, ``warmup_steps``, ``lr``, ``min_lr``, ``betas`` or
    ``weight_decay`` takes them from its first step (the optimizer's moments are kept). With an unchanged config the
    values are bitwise those of an uninterrupted run. Returns the learning rate of ``step``."""
    factor = scheduler.lr_lambdas[0]
    scheduler.base_lrs = [train.lr for _ in optimizer.param_groups]
    scheduler.last_epoch = step
    for group in optimizer.param_groups:
        group["initial_lr"] = train.lr
        group["lr"] = train.lr * factor(step)
        group["betas"] = train.betas
        group["weight_decay"] = train.weight_decay if group.get("name", "decay") == "decay" else 0.0
    set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])
    return optimizer.param_groups[0]["lr"]


def grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of all gradients, as one plain tensor on every rank (``automodel.clip_grad_norm_``'s)."""
    return total_grad_norm(parameters)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale the gradients so their global norm is at most ``max_norm`` (``None``: only measure it); returns the norm
    before clipping."""
    if max_norm is None:
        return total_grad_norm(parameters)
    return clip_grad_norm_(parameters, max_norm)
