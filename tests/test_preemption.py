"""Preemption through the ``automodel`` command, as a scheduler delivers it: a SIGTERM to the command or to one rank
ends the run after the current step with a complete checkpoint (status 0, no process left behind), and resuming
reproduces the uninterrupted losses bitwise; a second signal during that save leaves the previous checkpoint the
newest."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from automodel.training.preemption import DUPLICATE_WINDOW_S
from tests.conftest import REPO
from tests.recipe_runs import STEPS, Command, alive, children, losses, make_project

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # whole `automodel` launches: ~30 s each


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("preemption"))


@pytest.fixture(scope="module")
def uninterrupted(project):
    checkpoints = project / "uninterrupted"
    status, stdout = Command(project, checkpoints).finish()
    assert status == 0, stdout
    return losses(checkpoints / f"step_{STEPS:08d}")


def _resume_and_compare(project: Path, checkpoints: Path, uninterrupted: list[float]) -> None:
    status, stdout = Command(project, checkpoints, overrides=("checkpoint.keep=10",)).finish()
    assert status == 0 and f"automodel sft: {STEPS} steps" in stdout, stdout
    assert losses(checkpoints / f"step_{STEPS:08d}") == uninterrupted


def _saved_once_then_resumes(project: Path, checkpoints: Path, workers: list[int], uninterrupted: list[float]) -> None:
    """After a preemption at step 3 or later: no worker left, one complete checkpoint that LATEST names, holding the
    uninterrupted losses so far, and a resumed run that reproduces them all."""
    assert alive(workers) == [], "no training process outlives the command"
    saved = sorted(path.name for path in checkpoints.glob("step_*"))
    assert len(saved) == 1 and (checkpoints / "LATEST").read_text().strip() == saved[0], saved
    stopped_at = int(saved[0][5:])
    assert 3 <= stopped_at < STEPS and losses(checkpoints / saved[0]) == uninterrupted[:stopped_at]
    _resume_and_compare(project, checkpoints, uninterrupted)


@pytest.mark.parametrize("target", ["command", "one_rank", "every_process"])
def test_sigterm_saves_after_the_step_exits_0_and_resumes_bitwise(project, uninterrupted, tmp_path, target):
    """``every_process``: as SLURM delivers it, to every process of the job step at once (the command, torchrun and
    both workers), which the workers then also get forwarded: one notice, one save."""
    checkpoints = tmp_path / "checkpoints"
    command = Command(project, checkpoints)
    command.wait_for("step 3 |")
    workers = command.workers()
    assert len(workers) == 2, workers
    targets = {
        "command": [command.process.pid],
        "one_rank": [workers[1]],
        "every_process": [command.process.pid, *children(command.process.pid), *workers],
    }[target]
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    status, stdout = command.finish()
    assert status == 0, "".join(command.lines[-30:])
    assert "automodel sft: stopped by SIGTERM after step" in stdout and "checkpoint" in stdout, stdout
    _saved_once_then_resumes(project, checkpoints, workers, uninterrupted)


def test_ctrl_c_saves_after_the_step_exits_130_and_resumes_bitwise(project, uninterrupted, tmp_path):
    """Ctrl-C as a terminal delivers it: SIGINT to every process of the foreground group (the command, torchrun and
    both workers). The workers save after their step and end, torchrun does not kill them, no traceback is printed,
    and the command exits with the shell's status for an interrupt."""
    checkpoints = tmp_path / "checkpoints"
    command = Command(project, checkpoints, own_process_group=True)
    command.wait_for("step 3 |")
    workers = command.workers()
    assert len(workers) == 2, workers
    os.killpg(command.process.pid, signal.SIGINT)
    status, stdout = command.finish()
    assert status == 130, "".join(command.lines[-30:])
    assert "automodel sft: interrupted by Ctrl-C after step" in stdout and "checkpoint" in stdout, stdout
    said = [line for line in command.lines if "Ctrl-C received" in line]
    assert len(said) == 1 and "press Ctrl-C again to stop without saving" in said[0], command.lines[-30:]
    assert not any("Traceback" in line for line in command.lines), "".join(command.lines[-60:])
    _saved_once_then_resumes(project, checkpoints, workers, uninterrupted)


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_second_signal_during_the_save_leaves_the_previous_checkpoint_newest(project, uninterrupted, tmp_path, how):
    checkpoints = tmp_path / "checkpoints"
    env = {
        "PYTHONPATH": os.pathsep.join([str(project / "hooks"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "AUTOMODEL_TEST_SAVE_DELAY": str(5 * DUPLICATE_WINDOW_S),
    }
    # A periodic checkpoint first (step 4), then the preemption save, interrupted.
    command = Command(
        project, checkpoints, env, overrides=("checkpoint.every_steps=4",), own_process_group=how == "Ctrl-C"
    )

    def send() -> None:
        if how == "Ctrl-C":
            os.killpg(command.process.pid, signal.SIGINT)
        else:
            os.kill(command.process.pid, signal.SIGTERM)

    command.wait_for("step 5 |")
    send()
    # A worker runs its handler between bytecodes, possibly long after the kill: time the window from rank 0's message
    # (the only one: the ranks handle the signal within a step of each other).
    command.wait_for(f"{how} received")
    received = time.monotonic()
    deadline = received + 120
    while not list(checkpoints.glob("*.partial")):
        assert time.monotonic() < deadline and command.process.poll() is None, "".join(command.lines[-30:])
        time.sleep(0.01)
    # Past the window in which a signal counts as a copy of the first; the slowed save is still running.
    time.sleep(max(0.0, received + 1.5 * DUPLICATE_WINDOW_S - time.monotonic()))
    assert [p.name for p in checkpoints.glob("step_????????")] == ["step_00000004"], "the save must still be running"
    send()
    status, _ = command.finish()
    assert status != 0, "the interrupted save is no success"
    assert any(f"second {how}: stopping now" in line for line in command.lines), "".join(command.lines[-30:])
    complete = sorted(path.name for path in checkpoints.glob("step_????????"))
    assert complete == ["step_00000004"], complete
    assert (checkpoints / "LATEST").read_text().strip() == "step_00000004"
    _resume_and_compare(project, checkpoints, uninterrupted)
