"""The run's log file, and one screen for a failure.

The ``automodel`` command starts torchrun with its output piped through :class:`RunLog`: every byte still reaches the
terminal as it comes (progress bars included), and every line is also written to ``log.dir/<recipe>-<time>-<host>.log``
with the progress bars' carriage-return redraws dropped, so the file reads as a plain log.

A training process that raises (under the command: ``AUTOMODEL_FAILURE_DIR`` is set) first writes a small report
(:func:`report_failure`: its rank, the exception and the innermost frames of the project's or the user's code) and then
prints its traceback as usual. From the first report on, the output goes to the log file only: the failing ranks'
tracebacks, the other ranks' errors that follow from it, torchrun's ``ChildFailedError`` block. When torchrun has
ended, :meth:`RunLog.failure_summary` says on one screen which ranks failed and how, and where the log file is.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from automodel.distributed.runtime import PROGRESS_BARS_VARIABLE

__all__ = ["FAILURE_DIR_VARIABLE", "RunLog", "report_failure"]

#: Where a training process writes its failure report (set by the command for the processes it starts).
FAILURE_DIR_VARIABLE = "AUTOMODEL_FAILURE_DIR"
_FRAMES_SHOWN = 4
_MESSAGE_LINES = 6
_OTHER_FAILURES_SHOWN = 3
_DRAIN_SECONDS = 60.0
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_LIBRARY_DIRS = tuple(
    Path(path).resolve()
    for path in {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def report_failure(error: BaseException, rank: int) -> None:
    """Write this training process's failure report where the command reads it (nothing without the command)."""
    folder = os.environ.get(FAILURE_DIR_VARIABLE)
    if not folder:
        return
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _is_own_code(frame.filename)]
    report = {
        "rank": rank,
        "time": time.time(),
        "type": type(error).__name__,
        "message": str(error),
        "frames": [[frame.filename, frame.lineno, frame.name, frame.line or ""] for frame in frames[-_FRAMES_SHOWN:]],
    }
    path = Path(folder) / f"rank{rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)  # whole or absent: the command may read it at any time


def _is_own_code(filename: str) -> bool:
    """The project's code or the user's (a script, a sidecar), not torch's, transformers' or Python's."""
    path = Path(filename).resolve()
    if path.is_relative_to(_PACKAGE_DIR):
        return True
    return not any(path.is_relative_to(library) for library in _LIBRARY_DIRS) and not filename.startswith("<")


@dataclass
class _Failure:
    ranks: list[int]
    time: float
    type: str
    message: str
    frames: list[list[Any]]


class RunLog:
    """The log file of one ``automodel`` launch and the pumps that copy torchrun's output into it."""

    def __init__(self, folder: Path, recipe: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = _unused(folder / f"{recipe}-{stamp}-{socket.gethostname()}.log")
        self.failures = self.path.with_suffix(".failures")
        self.failures.mkdir()
        self._file = self.path.open("w", encoding="utf-8", errors="replace")
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._failed = False

    def environment(self) -> dict[str, str]:
        """What the training processes need: where to report a failure, and unbuffered output (the step lines reach
        the screen and the file as they are printed, not when a buffer fills)."""
        environment = {FAILURE_DIR_VARIABLE: str(self.failures), "PYTHONUNBUFFERED": "1"}
        if sys.stderr.isatty():  # the bars pass through the pipe to it (and are dropped from the file)
            environment[PROGRESS_BARS_VARIABLE] = "1"
        return environment

    def pump(self, source: IO[bytes] | None, terminal: IO[str]) -> None:
        """Copy ``source`` (a pipe of torchrun's output) to ``terminal`` and to the file, in a thread, until it ends."""
        if source is None:
            return
        thread = threading.Thread(target=self._pump, args=(source, terminal), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _pump(self, source: IO[bytes], terminal: IO[str]) -> None:
        screen = getattr(terminal, "buffer", None)
        pending = b""
        while chunk := source.read(65536):
            if not self.failed():
                if screen is not None:
                    screen.write(chunk)
                else:
                    terminal.write(chunk.decode(errors="replace"))
                terminal.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            self._write(lines)
        if pending:
            self._write([pending])

    def _write(self, lines: list[bytes]) -> None:
        # A progress bar redraws its line after "\r": the file keeps what the line ends as.
        text = "".join(line.rsplit(b"\r", 1)[-1].decode(errors="replace") + "\n" for line in lines)
        with self._lock:
            if self._file.closed:  # a pump still running after finish() gave up waiting for it
                return
            self._file.write(text)
            self._file.flush()

    def failed(self) -> bool:
        """Whether a training process has reported a failure (the folder is listed until one has)."""
        self._failed = self._failed or any(self.failures.iterdir())
        return self._failed

    def finish(self, status: int, recipe: str, *, signalled: bool = False) -> list[str]:
        """Wait for the pumps to drain; the lines to print now that torchrun ended with ``status`` (also written to
        the file): why the run failed, on one screen, and where the log is. Nothing to say for a run that succeeded
        or was stopped by a signal it was sent (``signalled``) without a failure."""
        for thread in self._threads:
            # The pipes close when torchrun's processes have all ended; a worker that outlives a killed torchrun
            # keeps its end open, and the command does not wait for it past this.
            thread.join(timeout=_DRAIN_SECONDS)
        failures = self._read_failures()
        shutil.rmtree(self.failures, ignore_errors=True)
        if failures:
            lines = self._summary(failures, recipe)
        elif status != 0 and not signalled:
            lines = [
                f"automodel {recipe}: the training processes ended with status {status} without a Python error "
                "(killed by a signal, or out of memory?)",
                f"automodel {recipe}: full log (every rank's output and torchrun's report): {self.path}",
            ]
        else:
            lines = [f"automodel {recipe}: log in {self.path}"]
        self._write([line.encode() for line in lines])
        with self._lock:
            self._file.close()
        return lines

    def _summary(self, failures: list[_Failure], recipe: str) -> list[str]:
        """The first failure (by time) with its message and innermost frames, one line for each other kind of
        failure, and where the full log is."""
        first, *others = failures
        lines = [f"automodel {recipe}: {_ranks(first.ranks)} failed: {first.type}: {_shortened(first.message)}"]
        if first.frames:
            lines.append("innermost frames of the project's or your code (most recent call last):")
        for filename, lineno, function, code in first.frames:
            lines.append(f'  File "{filename}", line {lineno}, in {function}')
            if code:
                lines.append(f"    {code}")
        for other in others[:_OTHER_FAILURES_SHOWN]:
            lines.append(f"then {_ranks(other.ranks)}: {other.type}: {_shortened(other.message, lines=1)}")
        if len(others) > _OTHER_FAILURES_SHOWN:
            lines.append(f"... and {len(others) - _OTHER_FAILURES_SHOWN} other failures")
        lines.append(f"automodel {recipe}: full log (every rank's traceback and torchrun's output): {self.path}")
        return lines

    def _read_failures(self) -> list[_Failure]:
        """The reports, the same exception on several ranks as one failure, earliest first."""
        grouped: dict[tuple[str, str], _Failure] = {}
        for path in sorted(self.failures.glob("rank*.json")):
            report = json.loads(path.read_text())
            key = (report["type"], report["message"])
            if key in grouped:
                grouped[key].ranks.append(report["rank"])
                grouped[key].time = min(grouped[key].time, report["time"])
            else:
                grouped[key] = _Failure(
                    [report["rank"]], report["time"], report["type"], report["message"], report["frames"]
                )
        for failure in grouped.values():
            failure.ranks.sort()
        return sorted(grouped.values(), key=lambda failure: (failure.time, failure.ranks))


def _unused(path: Path) -> Path:
    """``path``, or ``path`` with a number added when a launch in the same second on this host took it."""
    candidate, number = path, 1
    while candidate.exists() or candidate.with_suffix(".failures").exists():
        number += 1
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
    return candidate


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}-{ranks[-1]} ({len(ranks)} ranks)"
    return f"ranks {shown}"


def _shortened(message: str, lines: int = _MESSAGE_LINES) -> str:
    kept = message.strip().splitlines() or [""]
    if len(kept) > lines:
        kept = [*kept[:lines], f"... ({len(kept) - lines} more lines in the log)"]
    return "\n".join(kept)
