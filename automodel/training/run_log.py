"""The run's log file, and one screen for a failure.

The ``automodel`` command starts torchrun with its output piped through :class:`RunLog`: every byte still reaches the
terminal as it comes (progress bars included), and every line is also written to ``log.dir/<recipe>-<time>-<host>.log``
with the progress bars' carriage-return redraws dropped, so the file reads as a plain log.

A training process that raises (under the command: ``AUTOMODEL_FAILURE_DIR`` is set) first writes a small report
(:func:`report_failure`: its rank, the exception and the innermost frames of the project's or the user's code) and then
prints its traceback as usual. From the first report on, the output goes to the log file only: the failing ranks'
tracebacks, the other ranks' errors that follow from it, torchrun's ``ChildFailedError`` block. When torchrun has
ended, :meth:`RunLog.finish` says on one screen which ranks failed and how, and where the log file is.

A restart (``--max-restarts``) is not a failure of the run. torchrun runs under :mod:`automodel.training.launch`,
which, each time torchrun finds a failed worker (after it has stopped the group's other workers, before it starts
them again or ends), writes one marker line (:func:`worker_failure_line`) to its stdout and stderr: in each stream it
comes after every line of the stopped workers and before any line of the restarted ones. The pumps take the marker out
of the output; for a failure torchrun restarts after, the terminal gets one line (``rank 1 died (SIGKILL) after step
20; torchrun restarts the processes (restart 1 of 1)``) and the output goes to it again. Reports are kept per attempt
(``TORCHELASTIC_RESTART_COUNT``): the summary is of the attempt that ended the run, printed only when it failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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

__all__ = ["FAILURE_DIR_VARIABLE", "RunLog", "record_progress", "report_failure", "worker_failure_line"]

#: Where a training process writes its failure report (set by the command for the processes it starts).
FAILURE_DIR_VARIABLE = "AUTOMODEL_FAILURE_DIR"
#: The start of the line the launcher writes when torchrun finds a failed worker; a JSON object and a newline follow.
_WORKER_FAILURE_MARKER = b"@@automodel-launch: worker failed "
_PROGRESS_FILE = "progress"
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
    failed_at = getattr(error, "failed_at", None)  # a pipeline stage's failure: when it began
    error, stack, where = _unwrapped(error)
    frames = [frame for frame in stack if _is_own_code(frame.filename)]
    report = {
        "rank": rank,
        "attempt": _attempt(),
        "time": failed_at or time.time(),
        "type": type(error).__name__,
        "message": str(error) + where,
        "frames": [[frame.filename, frame.lineno, frame.name, frame.line or ""] for frame in frames[-_FRAMES_SHOWN:]],
    }
    _write_whole(Path(folder) / f"attempt{_attempt()}-rank{rank}.json", json.dumps(report))


def _unwrapped(error: BaseException) -> tuple[BaseException, traceback.StackSummary, str]:
    """The exception to report, its stack, and where it was raised when that is not this process's own frames.

    ``torch.distributed.checkpoint`` gathers the exception each rank raised into one ``CheckpointException`` (a
    ``BaseException`` whose message is every rank's whole traceback): the report is the lowest failed rank's own
    exception, with that rank's frames."""
    failures = getattr(error, "failures", None)
    if type(error).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        rank = min(failures)
        inner, stack = failures[rank]
        return inner, stack, f" (in torch.distributed.checkpoint, on rank {rank})"
    return error, traceback.extract_tb(error.__traceback__), ""


def record_progress(step: int) -> None:
    """Note the last step the run completed where the command reads it (rank 0, after each step; nothing without the
    command): a restart's line says after which step a process died."""
    folder = os.environ.get(FAILURE_DIR_VARIABLE)
    if folder:
        _write_whole(Path(folder) / _PROGRESS_FILE, str(step))


def worker_failure_line(exitcode: int, local_rank: int) -> bytes:
    """The marker line for a worker torchrun found failed: its exit status (minus the signal number for a signal)
    and its local rank."""
    return _WORKER_FAILURE_MARKER + json.dumps({"exitcode": exitcode, "local_rank": local_rank}).encode() + b"\n"


def _attempt() -> int:
    """Which attempt of the run this process belongs to: 0, then 1 after torchrun's first restart, and so on."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _write_whole(path: Path, text: str) -> None:
    partial = path.with_suffix(".part")
    partial.write_text(text)
    os.replace(partial, path)  # whole or absent: the command may read it at any time


def _is_own_code(filename: str) -> bool:
    """The project's code or the user's (a script, a sidecar), not torch's, transformers' or Python's."""
    path = Path(filename).resolve()
    if path.is_relative_to(_PACKAGE_DIR):
        return True
    return not any(path.is_relative_to(library) for library in _LIBRARY_DIRS) and not filename.startswith("<")


@dataclass
class _Stream:
    """What one pump carries between reads: the file's unfinished line, a tail held back as the possible start of a
    marker, the worker failures it has brought, and the attempt its output belongs to."""

    pending: bytes = b""
    held: bytes = b""
    worker_failures: int = 0
    attempt: int = 0


@dataclass
class _Failure:
    ranks: list[int]
    time: float
    type: str
    message: str
    frames: list[list[Any]]


class RunLog:
    """The log file of one ``automodel`` launch and the pumps that copy torchrun's output into it.

    ``max_restarts`` is torchrun's (a worker failure after which torchrun restarts the processes is announced, not
    summarized); ``single_node``: the local ranks torchrun names are the global ranks."""

    def __init__(self, folder: Path, recipe: str, *, max_restarts: int = 0, single_node: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = _unused(folder / f"{recipe}-{stamp}-{socket.gethostname()}.log")
        self.failures = self.path.with_suffix(".failures")
        self.failures.mkdir()
        self._recipe = recipe
        self._max_restarts = max_restarts
        self._single_node = single_node
        self._file = self.path.open("w", encoding="utf-8", errors="replace")
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._failed_attempts: set[int] = set()
        self._worker_failures: list[dict[str, int]] = []  # torchrun's, in order (each stream brings each once)

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
        stream = _Stream()
        while chunk := source.read(65536):
            self._take(stream.held + chunk, stream, terminal)
        self._show(stream.held, stream, terminal)
        if stream.pending:
            self._write([stream.pending])

    def _take(self, data: bytes, stream: _Stream, terminal: IO[str]) -> None:
        """Show ``data`` but for the launcher's marker lines, which are acted on; hold back a tail that may be the
        start of one (a marker split between two reads)."""
        while (start := data.find(_WORKER_FAILURE_MARKER)) >= 0 and (end := data.find(b"\n", start)) >= 0:
            self._show(data[:start], stream, terminal)
            self._on_worker_failure(json.loads(data[start + len(_WORKER_FAILURE_MARKER) : end]), stream, terminal)
            data = data[end + 1 :]
        stream.held = _marker_start(data)
        self._show(data[: len(data) - len(stream.held)], stream, terminal)

    def _show(self, data: bytes, stream: _Stream, terminal: IO[str]) -> None:
        if not data:
            return
        if not self.failed(stream.attempt):
            screen = getattr(terminal, "buffer", None)
            if screen is not None:
                screen.write(data)
            else:
                terminal.write(data.decode(errors="replace"))
            terminal.flush()
        *lines, stream.pending = (stream.pending + data).split(b"\n")
        self._write(lines)

    def _on_worker_failure(self, failure: dict[str, int], stream: _Stream, terminal: IO[str]) -> None:
        """torchrun found worker ``failure`` failed and has stopped the others: announce the restart that follows
        (once, whichever stream brings the marker first); this stream's output is of the next attempt from here on."""
        stream.worker_failures += 1
        number = stream.worker_failures
        with self._lock:
            first = number > len(self._worker_failures)
            if first:
                self._worker_failures.append(failure)
        if number <= self._max_restarts:
            stream.attempt = number
            if first:
                line = (
                    f"automodel {self._recipe}: {self._describe(failure, attempt=number - 1)}; torchrun restarts the "
                    f"processes (restart {number} of {self._max_restarts})"
                )
                terminal.write(line + "\n")
                terminal.flush()
                self._write([line.encode()])

    def _describe(self, failure: dict[str, int], attempt: int) -> str:
        """``rank 1 died (SIGKILL) after step 20``: who, how (its report's error, if it wrote one), when."""
        local_rank, exitcode = failure["local_rank"], failure["exitcode"]
        who = f"rank {local_rank}" if self._single_node else f"local rank {local_rank} on {socket.gethostname()}"
        reports = self._reports(attempt)
        report = next((report for report in reports if report["rank"] == local_rank), None)
        if exitcode < 0:
            how = f"died ({_signal_name(-exitcode)})"
        elif report is not None and self._single_node:
            how = f"failed ({report['type']}: {_shortened(report['message'], lines=1)})"
        else:
            how = f"failed (exit status {exitcode})"
        progress = self.failures / _PROGRESS_FILE
        when = f" after step {progress.read_text()}" if progress.exists() else " before its first step"
        return f"{who} {how}{when}"

    def _write(self, lines: list[bytes]) -> None:
        # A progress bar redraws its line after "\r": the file keeps what the line ends as.
        text = "".join(line.rsplit(b"\r", 1)[-1].decode(errors="replace") + "\n" for line in lines)
        with self._lock:
            if self._file.closed:  # a pump still running after finish() gave up waiting for it
                return
            self._file.write(text)
            self._file.flush()

    def failed(self, attempt: int = 0) -> bool:
        """Whether a training process of ``attempt`` has reported a failure (the folder is listed until one has)."""
        if attempt not in self._failed_attempts and any(self.failures.glob(f"attempt{attempt}-rank*.json")):
            self._failed_attempts.add(attempt)
        return attempt in self._failed_attempts

    def finish(self, status: int, recipe: str, *, signalled: bool = False) -> list[str]:
        """Wait for the pumps to drain; the lines to print now that torchrun ended with ``status`` (also written to
        the file): why the run failed, on one screen, and where the log is. Nothing to say for a run that succeeded
        (after restarts or not) or was stopped by a signal it was sent (``signalled``) without a failure."""
        for thread in self._threads:
            # The pipes close when torchrun's processes have all ended; a worker that outlives a killed torchrun
            # keeps its end open, and the command does not wait for it past this.
            thread.join(timeout=_DRAIN_SECONDS)
        last = min(len(self._worker_failures), self._max_restarts)  # the attempt that ended the run
        failures = self._read_failures(last)
        ended_by = self._worker_failures[last] if len(self._worker_failures) > last else None
        shutil.rmtree(self.failures, ignore_errors=True)
        if failures:
            lines = self._summary(failures, recipe)
        elif status != 0 and not signalled:
            what = f"the training processes ended with status {status}"
            if ended_by is not None:
                what = self._describe(ended_by, last)
            lines = [
                f"automodel {recipe}: {what} without a Python error (killed by a signal, or out of memory?)",
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

    def _reports(self, attempt: int) -> list[dict[str, Any]]:
        return [json.loads(path.read_text()) for path in sorted(self.failures.glob(f"attempt{attempt}-rank*.json"))]

    def _read_failures(self, attempt: int) -> list[_Failure]:
        """The reports of ``attempt``, the same exception on several ranks as one failure, earliest first."""
        grouped: dict[tuple[str, str], _Failure] = {}
        for report in self._reports(attempt):
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


def _marker_start(data: bytes) -> bytes:
    """The tail of ``data`` that is, or may become, a marker line: an unfinished one, or a start of the marker."""
    start = data.find(_WORKER_FAILURE_MARKER)
    if start >= 0:
        return data[start:]
    for size in range(min(len(_WORKER_FAILURE_MARKER) - 1, len(data)), 0, -1):
        if data.endswith(_WORKER_FAILURE_MARKER[:size]):
            return data[-size:]
    return b""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
