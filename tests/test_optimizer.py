"""The recipes' optimizer on a rank that holds no trainable parameter (a pipeline stage without LoRA adapters)."""

from __future__ import annotations

import torch

from automodel.training.config import TrainSection
from automodel.training.optim import make_optimizer, make_scheduler, resume_schedule


def test_a_rank_without_trainable_parameters_gets_an_optimizer_that_steps_with_its_schedule():
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    train = TrainSection(max_steps=4, lr=1e-3, warmup_steps=2)
    optimizer = make_optimizer(model, train)
    scheduler = make_scheduler(optimizer, train)
    assert [len(group["params"]) for group in optimizer.param_groups] == [0]
    optimizer.step()
    scheduler.step()
    assert resume_schedule(optimizer, scheduler, train, 3) == scheduler.get_last_lr()[0] > 0
