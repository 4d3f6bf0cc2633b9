"""A torchrun entry point for the restart and hang tests: ``automodel``'s training process, whose rank 1 misbehaves
in the first attempt: ``kill`` (SIGKILL, as the OOM killer or a lost node would) or ``hang`` (stops participating:
sleeps in the step) during step ``STEP + 1``; ``kill-in-save``: SIGKILL from inside the writing of the checkpoint of
step ``STEP`` (with ``checkpoint.async=true``, in the background while training goes on). Rank 0 of the attempt that
finishes writes its losses to ``OUT`` (JSON).

    torchrun --max-restarts=1 ... tests/scripts/misbehaving_rank.py kill|hang|kill-in-save OUT STEP sft --config FILE
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from automodel.training import cli, loop


def main() -> None:
    mode, out, step, argv = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ["RANK"] == "1":
        steps, train_step = [0], loop.train_step

        def misbehaving_step(*args, **kwargs):
            steps[0] += 1
            if steps[0] > step and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if steps[0] > step and mode == "hang":
                time.sleep(3600)
            return train_step(*args, **kwargs)

        loop.train_step = misbehaving_step
        write_data = _FileSystemWriter.write_data

        def dying_write(self, *args, **kwargs):
            if mode == "kill-in-save" and f"step_{step:08d}.partial" in str(self.path):
                os.kill(os.getpid(), signal.SIGKILL)
            return write_data(self, *args, **kwargs)

        _FileSystemWriter.write_data = dying_write
    run = loop.run

    def recorded(config):
        result = run(config)
        if os.environ["RANK"] == "0":
            out.write_text(json.dumps({"losses": result.losses, "resumed_from": result.resumed_from}))
        return result

    loop.run = recorded
    cli._exit_without_teardown(cli.main(argv))


if __name__ == "__main__":
    main()
