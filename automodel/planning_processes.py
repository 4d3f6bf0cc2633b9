"""The processes ``automodel.plan`` simulates ranks in: one helper process that imports the simulation's module once,
and one child forked from it per simulated rank (the function a job names runs there, under torch's fake process
group).

A job names its function as ``"module:function"``: the helper imports that module before its first fork (torch and
transformers with it: seconds that each child would pay again), and this module imports none of the planner's.

A child that fails returns its error in one line (its type, message and innermost frame); the caller raises it once,
as :class:`SimulationError`, with no second traceback from the helper.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["SimulationError", "one_line", "simulate_elsewhere", "start_helper"]


class SimulationError(RuntimeError):
    """A simulated rank failed outside the checks the real run makes (those are refusals, not errors): the rank,
    the error's type and message, and where it was raised."""


def simulate_elsewhere(function: str, request: Any, rank: int, *, classes: bool) -> dict[str, Any]:
    """``function(request, rank, classes)`` (``"module:function"``: ``planning_simulation.simulate_here``) for one simulated
    rank of ``request`` (``planning_simulation.Request``) in a fresh process (see :class:`_ForkServer`): what it returns
    there, or its error raised here as :class:`SimulationError`, once.

    A fresh process per rank, because one process cannot be two ranks in a row: device meshes compare equal by
    their layout alone, not by the rank that built them, so DTensor's sharding caches (in Python and C++) would hand
    the second rank meshes of the first, with the first rank's coordinates.
    """
    server = start_helper(function)
    kind, value = server.run((function, (request, rank, classes)))
    if kind != "ok":
        raise SimulationError(f"simulating rank {rank} of {request.world_size} failed: {value}")
    return value


def start_helper(function: str) -> _ForkServer:
    """The helper process, started (once) with ``function``'s module imported: a caller that starts it early lets
    those seconds of imports run beside its own work."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.process.poll() is not None:
            _SERVER = _ForkServer(function.partition(":")[0])
        return _SERVER


class _ForkServer:
    """A helper process that imports the libraries once and forks one fresh child per simulated rank.

    Why not ``multiprocessing``: its spawn and forkserver contexts run the caller's ``__main__`` again in every
    child (a script without an ``if __name__ == "__main__"`` guard would plan recursively), and starting a fresh
    interpreter per rank costs the 5-9 s of importing torch and transformers each time. The helper reads one job
    per line (a request file and a result file) and answers with the child's pid; the child writes its result and
    exits, and the helper never runs a process group itself.
    """

    def __init__(self, preload: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from automodel.planning_processes import _serve; _serve({preload!r})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lock = threading.Lock()
        atexit.register(self.close)

    def run(self, job: tuple) -> tuple[str, Any]:
        with tempfile.TemporaryDirectory() as folder:
            job_file, result_file = Path(folder) / "job.pickle", Path(folder) / "result.pickle"
            job_file.write_bytes(pickle.dumps(job))
            with self.lock:
                self.process.stdin.write(f"{job_file}\t{result_file}\n")
                self.process.stdin.flush()
                answer = self.process.stdout.readline()
            if not answer.strip().isdigit():
                return "error", f"the planning helper process ended (exit code {self.process.poll()})"
            pid = int(answer)
            while _alive(pid):
                time.sleep(0.02)
            if not result_file.is_file():
                return "error", f"the simulating process {pid} died without a result (killed, or out of memory?)"
            return pickle.loads(result_file.read_bytes())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_SERVER: _ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve(preload: str) -> None:
    """The helper's loop (see :class:`_ForkServer`): import ``preload`` (the simulation's module), then fork one child
    per job line on stdin and print its pid: every child starts with the module imported."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    try:
        importlib.import_module(preload)
    except BaseException:  # noqa: BLE001 - each child imports it again and reports the error in one line
        pass
    for line in sys.stdin:
        job_file, result_file = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            _run_child(Path(job_file), Path(result_file))
        print(pid, flush=True)


def _run_child(job_file: Path, result_file: Path) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # the helper's stdout is its answer channel
    try:
        function, args = pickle.loads(job_file.read_bytes())
        module, _, name = function.partition(":")
        outcome = ("ok", getattr(importlib.import_module(module), name)(*args))
    except BaseException as error:  # the parent raises it, in one line
        outcome = ("error", one_line(error))
    partial = result_file.with_suffix(".part")
    partial.write_bytes(pickle.dumps(outcome))
    os.replace(partial, result_file)
    os._exit(0)


def one_line(error: BaseException) -> str:
    """``Type: message (at file:line in function)``: the error and the innermost frame it was raised in, of the
    project's code where there is one (the frames themselves stay in the child: no second traceback)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if f"{os.sep}automodel{os.sep}" in frame.filename] or frames
    where = f" (at {_short(ours[-1].filename)}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    message = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {message}{where}"


def _short(filename: str) -> str:
    marker = f"{os.sep}automodel{os.sep}"
    return "automodel" + os.sep + filename.rsplit(marker, 1)[1] if marker in filename else filename
