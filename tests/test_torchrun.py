"""`torchrun` just works: the README example runs on 2 CPU ranks, starting its own process group from the
environment torchrun sets (``MeshContext.build`` initialises gloo without CUDA)."""

from __future__ import annotations

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
