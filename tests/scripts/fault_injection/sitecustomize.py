"""Faults for the tests that break a run through the real ``automodel`` command. With this folder on ``PYTHONPATH``,
every Python process imports this module at start-up; it acts only in the training process of rank
``AUTOMODEL_TEST_FAULT_RANK`` in torchrun's first attempt, as ``AUTOMODEL_TEST_FAULT`` says:

- ``kill:N``: the process SIGKILLs itself when step N + 1 starts (as the OOM killer or a lost node would);
- ``raise-in-mlp:N``: from step N + 1 on, the first MLP of its model (of its pipeline stages) raises ``ValueError("an
  MLP that cannot run")`` in its forward.

When the fault happens, ``time.time()`` is written to ``AUTOMODEL_TEST_FAULT_OUT``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _arm(fault: str, after: int, out: Path) -> None:
    from automodel.training import loop

    train_step, steps = loop.train_step, [0]

    def faulty_step(model, *args, **kwargs):
        steps[0] += 1
        if steps[0] == after + 1:
            out.write_text(str(time.time()))
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            stages = getattr(model, "stages", [model])
            mlp = next(
                module
                for stage in stages
                for module in stage.modules()
                if type(module).__name__.endswith("MLP") and not getattr(module, "absent_from_stage", False)
            )

            def failing_forward(*args, **kwargs):
                raise ValueError("an MLP that cannot run")

            mlp.forward = failing_forward
        return train_step(model, *args, **kwargs)

    loop.train_step = faulty_step


if (
    "AUTOMODEL_TEST_FAULT" in os.environ
    and "LOCAL_RANK" in os.environ
    and os.environ.get("RANK") == os.environ.get("AUTOMODEL_TEST_FAULT_RANK")
    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
):
    _fault, _after = os.environ["AUTOMODEL_TEST_FAULT"].split(":")
    _arm(_fault, int(_after), Path(os.environ["AUTOMODEL_TEST_FAULT_OUT"]))
