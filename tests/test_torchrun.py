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
