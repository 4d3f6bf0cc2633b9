"""torchrun, telling the ``automodel`` command of each failed worker it finds: ``python -m automodel.training.launch
[torchrun's arguments]`` is what the command starts instead of ``python -m torch.distributed.run``.

torchrun (``torch.distributed.run.main``) runs in this process unchanged. When it finds a worker ended with an error,
it stops the group's other workers, then restarts them (``--max-restarts``) or ends. Between the two, this writes one
marker line (:func:`~automodel.training.run_log.worker_failure_line`: the exit status and the local rank) to its
stdout and its stderr, the pipes the workers write to too; as the stopped workers have all ended, in each pipe it comes
after the last line of theirs and before the first of the restarted workers, which is what lets the command tell a
restart from the failure of the run (:class:`~automodel.training.run_log.RunLog`).
"""

from __future__ import annotations

import sys

from automodel._compat.torch import on_worker_failure

from .run_log import worker_failure_line

__all__ = ["main"]


def _tell_the_command(exitcode: int, local_rank: int, pid: int) -> None:
    line = worker_failure_line(exitcode, local_rank)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        stream.buffer.write(line)
        stream.flush()


def main() -> None:
    """Run torchrun with this process's arguments."""
    from torch.distributed.run import main as torchrun

    on_worker_failure(_tell_the_command)
    torchrun()


if __name__ == "__main__":
    main()
