"""What a pipeline rank raises when its part of a schedule step fails (``distributed.pipeline_failure``), in one
process; the whole run ending on every rank is tested through the command (``test_run_log.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel.distributed.pipeline_failure import StageFailure, ending_every_stage_on_failure


class _Broken(nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an MLP that cannot run\nsecond\nthird\nfourth\nfifth")


def _stage() -> nn.Module:
    stage = nn.Module()
    stage.layers = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), _Broken())])
    return stage


def test_the_rank_where_it_arose_names_its_stage_and_the_innermost_module():
    stages = [_stage(), _stage()]
    with pytest.raises(StageFailure) as raised:
        with ending_every_stage_on_failure(stages, [1, 3], 4):
            try:
                stages[1].layers[1](torch.zeros(2))
            except ValueError as error:  # as torch's stage re-raises a forward's error
                raise RuntimeError("stage forward failed with args of shapes ...") from error
    message = str(raised.value)
    assert message.startswith(
        "pipeline stage 3 of 4 (rank 0) failed in layers.1.1 (_Broken): ValueError: an MLP that cannot run\nsecond\n"
        "third\n... (2 more lines)\n"
    ), message
    assert "the run cannot continue" in message
    assert isinstance(raised.value.__cause__, RuntimeError) and raised.value.failed_at > 0


def test_a_peer_failing_in_a_receive_names_no_module_and_interrupts_pass_through():
    with pytest.raises(StageFailure, match=r"^pipeline stage 0 of 2 \(rank 0\) failed outside its modules' forwards"):
        with ending_every_stage_on_failure([_stage()], [0], 2):
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(KeyboardInterrupt):
        with ending_every_stage_on_failure([_stage()], [0], 2):
            raise KeyboardInterrupt
