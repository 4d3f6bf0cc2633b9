"""The run's log file and the one-screen failure summary (``automodel.training.run_log``): unit checks of the pump and
the summary, then the real ``automodel`` command on 2 CPU ranks failing in tokenization and in a model's forward."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from automodel.training.run_log import FAILURE_DIR_VARIABLE, RunLog, report_failure
from tests.cases.training import save_tiny_chat_checkpoint
from tests.conftest import REPO


class _Terminal(io.StringIO):
    def flush(self) -> None:
        pass


def test_the_file_keeps_whole_lines_and_the_terminal_gets_every_byte(tmp_path):
    log = RunLog(tmp_path / "logs", "sft")
    terminal = _Terminal()
    output = b"Loading 1/2\rLoading 2/2\r          \rstep 1 | loss 2.0\nstep 2 | loss 1.5\npartial"
    log.pump(io.BytesIO(output), terminal)
    assert log.finish(0, "sft") == [f"automodel sft: log in {log.path}"]
    assert terminal.getvalue() == output.decode()
    text = log.path.read_text()
    assert "\r" not in text
    assert text.splitlines() == [
        "step 1 | loss 2.0",
        "step 2 | loss 1.5",
        "partial",
        f"automodel sft: log in {log.path}",
    ]
    assert not log.failures.exists()


def test_after_the_first_failure_report_the_output_goes_to_the_file_only(tmp_path, monkeypatch):
    log = RunLog(tmp_path, "pretrain")
    monkeypatch.setenv(FAILURE_DIR_VARIABLE, str(log.failures))
    terminal = _Terminal()
    log.pump(io.BytesIO(b"step 1 | loss 2.0\n"), terminal)
    log._threads[-1].join()
    for rank in (1, 0):
        try:
            raise ValueError("record 3 is not a chat")
        except ValueError as error:
            report_failure(error, rank)
    time.sleep(0.01)
    try:
        raise RuntimeError("Connection closed by peer\nsecond line")
    except RuntimeError as error:
        report_failure(error, 2)
    log.pump(io.BytesIO(b"Traceback (most recent call last):\nChildFailedError\n"), terminal)
    lines = log.finish(1, "pretrain")
    assert terminal.getvalue() == "step 1 | loss 2.0\n"
    assert lines[0] == "automodel pretrain: ranks 0, 1 failed: ValueError: record 3 is not a chat"
    assert lines[1].startswith("innermost frames") and lines[2].startswith(f'  File "{__file__}", line ')
    assert lines[-2] == "then rank 2: RuntimeError: Connection closed by peer\n... (1 more lines in the log)"
    assert lines[-1] == f"automodel pretrain: full log (every rank's traceback and torchrun's output): {log.path}"
    text = log.path.read_text()
    assert "ChildFailedError" in text and lines[0] in text


def test_a_run_that_dies_without_a_report_says_so(tmp_path):
    log = RunLog(tmp_path, "sft")
    lines = log.finish(-9, "sft")
    assert "ended with status -9 without a Python error" in lines[0] and str(log.path) in lines[1]
    stopped = RunLog(tmp_path, "sft")
    assert stopped.path != log.path, "a second launch in the same second gets its own file"
    assert stopped.finish(130, "sft", signalled=True) == [f"automodel sft: log in {stopped.path}"]


def _automodel(tmp_path: Path, model: Path, data: Path) -> tuple[subprocess.CompletedProcess, float]:
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {data}}}\n"
        "train: {max_steps: 2, global_batch_size: 2, seq_len: 32}\nlog: {dir: logs}\n"
    )
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(config), "--nproc-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return result, time.perf_counter() - started


def _check_one_screen(result: subprocess.CompletedProcess, tmp_path: Path, message: str) -> str:
    screen = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 1, result.stderr
    assert len(screen) <= 25, "\n".join(screen)
    assert message in result.stderr, result.stderr
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    (log,) = (tmp_path / "logs").glob("sft-*.log")
    assert f"full log (every rank's traceback and torchrun's output): {log}" in screen[-1]
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") >= 3, "both ranks' tracebacks and torchrun's"
    assert "ChildFailedError" in text and "\r" not in text
    assert not list((tmp_path / "logs").glob("*.failures")), "the report folder is removed"
    return text


@pytest.mark.distributed
def test_a_data_error_found_in_tokenization_fits_one_screen(tmp_path):
    model = save_tiny_chat_checkpoint(tmp_path / "model")
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"foo": 1}) + "\n" + json.dumps({"foo": 2}) + "\n")
    result, seconds = _automodel(tmp_path, model, data)
    _check_one_screen(result, tmp_path, "ranks 0, 1 failed: ValueError: SFT record 0 has keys ['foo']")
    assert 'automodel/training/data.py", line' in result.stderr, "the project's innermost frames are shown"
    print(f"failed and summarised in {seconds:.1f} s")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_model_forward_error_fits_one_screen(tmp_path):
    """A checkpoint whose vocabulary is smaller than its tokenizer's: the embedding lookup fails in the forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.cases.training import CHAT_DATA

    model = save_tiny_chat_checkpoint(tmp_path / "model")
    config = AutoConfig.from_pretrained(model)
    config.vocab_size = 4
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    result, _ = _automodel(tmp_path, model, CHAT_DATA)
    text = _check_one_screen(result, tmp_path, "failed: IndexError: index out of range in self")
    assert "automodel/training/loop.py" in result.stderr and "in forward" in text
