"""Running the ``automodel`` command on the tiny recipe as a user or a scheduler does (tests of preemption and of
several nodes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests.conftest import REPO

STEPS = 24
# Workers only: make every checkpoint write take a while, so that a test can signal during it.
SLOW_SAVE = """
import os
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("AUTOMODEL_TEST_SAVE_DELAY"):
    import time
    import torch.distributed.checkpoint as dcp
    _save = dcp.save
    def save(*args, **kwargs):
        result = _save(*args, **kwargs)  # the files are written, the checkpoint not yet committed
        time.sleep(float(os.environ["AUTOMODEL_TEST_SAVE_DELAY"]))
        return result
    dcp.save = save
"""


class Command:
    """``automodel sft`` (2 processes on one node unless ``launch`` says otherwise), its stderr collected line by line."""

    def __init__(
        self,
        project: Path,
        checkpoints: Path,
        extra_env: dict[str, str] | None = None,
        overrides: tuple = (),
        launch: tuple = ("--nproc-per-node", "2"),
        own_process_group: bool = False,
    ) -> None:
        overrides = [
            f"model.path={project / 'tiny'}",
            f"checkpoint.dir={checkpoints}",
            f"train.max_steps={STEPS}",
            "export.dir=null",
            *overrides,
        ]
        command = [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(project / "sft_tiny.yaml")]
        env = {**os.environ, **(extra_env or {})}
        self.process = subprocess.Popen(
            [*command, *launch, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=own_process_group,  # a terminal's foreground group, to signal as Ctrl-C does
        )
        # Each pipe has one reader of its own: `communicate()` would read stderr too, and a line it took (the one a
        # test looks for) would never reach `lines`.
        self.lines: list[str] = []
        self._stdout: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stderr, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stdout, self._stdout), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for(self, text: str, timeout: float = 240, count: int = 1) -> None:
        """Until ``count`` lines of the output contain ``text``."""
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.lines) < count:
            assert self.process.poll() is None, "".join(self.lines[-40:])
            assert time.monotonic() < deadline, f"no {text!r} in:\n" + "".join(self.lines[-40:])
            time.sleep(0.05)

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        """The command's exit status and its whole stdout, once it and every process writing its output ended."""
        deadline = time.monotonic() + timeout
        self.process.wait(timeout=timeout)
        for reader in self._readers:  # until EOF: the workers share the command's pipes
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        return self.process.returncode, "".join(self._stdout)

    def workers(self) -> list[int]:
        """The training processes: the children of torchrun, the command's child."""
        torchrun = children(self.process.pid)
        return [pid for parent in torchrun for pid in children(parent)]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def losses(checkpoint: Path) -> list[float]:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=True)["losses"]


def make_project(folder: Path) -> Path:
    """The tiny recipe with its data in ``folder``, its model written once."""
    (folder / "data").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "sft_tiny.yaml", folder)
    shutil.copy(REPO / "recipes" / "data" / "smol_chat.jsonl", folder / "data")
    from automodel.training.tiny_model import write_tiny_model

    write_tiny_model(folder / "tiny", folder / "data" / "smol_chat.jsonl", seed=0)
    (folder / "hooks").mkdir()
    (folder / "hooks" / "sitecustomize.py").write_text(SLOW_SAVE)
    return folder
