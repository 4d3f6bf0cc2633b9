"""`torchrun` just works: the README example runs on 2 CPU ranks, starting its own process group from the
environment torchrun sets (``MeshContext.build`` initialises gloo without CUDA)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed


def test_readme_example_runs_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, str(REPO / "docs" / "examples" / "parallelize_by_hand.py")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LlamaForCausalLM: loss" in result.stdout and "on 2 ranks (dp=1, tp=2)" in result.stdout, result.stdout


def test_readme_training_loop_runs_under_torchrun_and_saves_a_checkpoint(tmp_path):
    """from_pretrained -> train() -> forward / backward -> torch's clip_grad_norm_ -> AdamW(foreach) -> save_pretrained
    on every rank (TP=2 on 2 ranks), run from another folder; plain transformers loads the result."""
    from transformers import AutoModelForCausalLM

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    output = tmp_path / "trained"
    script = REPO / "docs" / "examples" / "train_by_hand.py"
    result = subprocess.run(
        [*command, str(script), "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: loss" in result.stdout and "(LlamaForCausalLM, 2 ranks: dp=1, tp=2)" in result.stdout, result.stdout
    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.config.num_hidden_layers == 2 and (output / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "mode",
    [
        "kill-in-async-save",
        pytest.param("kill-in-step", marks=pytest.mark.slow),
    ],
)
def test_a_killed_rank_costs_one_restart_and_the_restart_resumes_from_the_checkpoint(tmp_path, mode):
    """Under torchrun's --max-restarts (what ``automodel sft --max-restarts 1`` passes on), rank 1 is SIGKILLed:
    from inside the background write of the step-10 checkpoint (``checkpoint.async=true``: training goes on while
    it is written), or during step 8 (synchronous checkpoints). torchrun restarts both processes, which resume from
    the step-5 checkpoint by themselves (the step-10 one was never committed) and finish with the losses of an
    uninterrupted run."""
    import json
    import os

    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint

    model = save_tiny_chat_checkpoint(tmp_path / "model")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {model}}}
data: {{path: {CHAT_DATA}}}
train: {{max_steps: 12, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, lr: 3.0e-3, warmup_steps: 3}}
checkpoint: {{dir: {tmp_path / "ckpt"}, every_steps: 5, async: {str(mode == "kill-in-async-save").lower()}}}
"""
    )
    script = REPO / "tests" / "scripts" / "misbehaving_rank.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    how, step = ("kill-in-save", 10) if mode == "kill-in-async-save" else ("kill", 7)
    runs = {}
    for name, restarts, kill_step in (("uninterrupted", 0, 1000), ("killed", 1, step)):
        out = tmp_path / f"{name}.json"
        overrides = [] if name == "killed" else [f"checkpoint.dir={tmp_path / 'plain'}"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   f"--max-restarts={restarts}", str(script), how, str(out), str(kill_step), "sft", "--config",
                   str(config),
                   *overrides]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=420, check=False, env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = (json.loads(out.read_text()), result.stdout + result.stderr)
    (plain, _), (killed, log) = runs["uninterrupted"], runs["killed"]
    assert killed["resumed_from"] == 5, log[-3000:]
    assert killed["losses"] == plain["losses"] and len(plain["losses"]) == 12
    assert f"restart 1 of 1: resuming from {tmp_path / 'ckpt' / 'step_00000005'}" in log, log[-3000:]
    assert f"automodel sft: newest checkpoint {tmp_path / 'ckpt' / 'step_00000012'}" in log, log[-3000:]
    if mode == "kill-in-async-save":
        assert "checkpoint of step 10: saving in the background" in log, log[-3000:]
    # Output to a pipe, not a terminal: no progress bar redraws, every step line whole.
    assert "\r" not in log, log[-3000:]
    assert re.search(r"^step 12 \| loss [\d.]+ \| lr .* \| [\d.]+ s$", log, re.MULTILINE), log[-3000:]


def test_a_rank_that_stops_participating_ends_the_run_with_its_stacks_not_a_hang(tmp_path):
    """train.hang_timeout_s=10: rank 1 stops in step 3; it dumps its stacks, says where it is (outside any
    collective) and exits with 124 well within the timeout + 60 s, and torchrun ends the run (rank 0, waiting in a
    collective, says so too when its watchdog fires first)."""
    import os
    import time

    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint

    model = save_tiny_chat_checkpoint(tmp_path / "model")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {model}}}
data: {{path: {CHAT_DATA}}}
train: {{max_steps: 12, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, hang_timeout_s: 10}}
"""
    )
    script = REPO / "tests" / "scripts" / "misbehaving_rank.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               "hang", str(tmp_path / "out.json"), "2", "sft", "--config", str(config)]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    log = result.stdout + result.stderr
    assert result.returncode != 0 and time.monotonic() - started < 10 + 60 + 60, log[-3000:]  # + start-up
    assert "Thread 0x" in log or "Current thread" in log, "faulthandler's stacks"
    assert "automodel: rank 1: no training step completed in" in log, log[-3000:]
    assert "rank 1: no training step completed" in log and "busy outside any collective" in log, log[-3000:]
    # Rank 0 waits in a collective; its own watchdog says so unless torchrun ends it first, once rank 1 has exited.
    rank0 = "automodel: rank 0: no training step completed"
    assert rank0 not in log or "waiting in torch.distributed's" in log.split(rank0)[1].split("\n")[0], log[-3000:]
    assert "after step 2" in log


def test_automodel_passes_max_restarts_to_torchrun(tmp_path, monkeypatch, recorded_torchrun):
    from automodel.training import cli

    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: {tmp_path}}}\ndata: {{path: {tmp_path}}}\n")
    launched = recorded_torchrun
    monkeypatch.setattr("automodel.training.prelaunch.check_before_launch", lambda config, world_size: [])
    assert cli.main(["sft", "--config", str(config), "--nproc-per-node", "2", "--max-restarts", "3"]) == 0
    assert "--max-restarts=3" in launched[0] and "--nproc-per-node=2" in launched[0]
    assert cli.main(["sft", "--config", str(config), "--max-restarts", "-1"]) == 2
    # torchrun's own spellings work too
    assert cli.main(["sft", "--config", str(config), "--nproc_per_node", "4", "--max_restarts", "1"]) == 0
    assert "--max-restarts=1" in launched[1] and "--nproc-per-node=4" in launched[1]
