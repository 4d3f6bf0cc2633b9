"""The pre-launch data check (``automodel.training.data_check``) on a big chat JSONL file, against its floors.

    python benchmarks/data_check.py                       # 1 GiB of chat records in a temporary folder
    python benchmarks/data_check.py --megabytes 256 --rounds 3 --out data_check.json

Contenders, each over the same file, interleaved round after round (medians reported, with each one's ratio to the
read floor):

- ``read``: the file read line by line, nothing parsed: the floor of any check that looks at every line.
- ``loads``: ``json.loads`` of every line and nothing else: the obvious check, one process.
- ``check/1``: ``check_jsonl(path, "sft", workers=1)``: every line parsed and checked as an SFT record.
- ``check``: ``check_jsonl(path, "sft")``: the same split among the CPUs (at most 8 processes), as the command runs it.

The records are chats of three turns (about 500 bytes a line), the shape of real SFT data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECORD = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer briefly, then say a little about its past."},
        {"role": "assistant", "content": "The capital of France is Paris. " * 8},
    ]
}


def write_file(path: Path, megabytes: int) -> int:
    """``megabytes`` MiB of chat records; the number of lines."""
    line = (json.dumps(RECORD) + "\n").encode()
    lines = (megabytes << 20) // len(line) + 1
    with path.open("wb") as file:
        for start in range(0, lines, 1000):
            file.write(line * min(1000, lines - start))
    return lines


def contenders(path: Path) -> dict:
    from automodel.training.data_check import check_jsonl

    def read() -> None:
        with path.open("rb") as file:
            for _ in file:
                pass

    def loads() -> None:
        with path.open("rb") as file:
            for line in file:
                json.loads(line)

    return {
        "read": read,
        "loads": loads,
        "check/1": lambda: check_jsonl(path, "sft", workers=1),
        "check": lambda: check_jsonl(path, "sft"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "chat.jsonl"
        lines = write_file(path, args.megabytes)
        seconds: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, run in contenders(path).items():
                start = time.perf_counter()
                run()
                seconds.setdefault(name, []).append(time.perf_counter() - start)
        size = path.stat().st_size
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "bytes": size,
        "lines": lines,
        "cpus": os.cpu_count(),
        "seconds": medians,
        "ratio_to_read": {name: value / medians["read"] for name, value in medians.items()},
    }
    for name, value in medians.items():
        print(
            f"{name:>8}: {value:6.2f} s  {size / value / 2**20:7.1f} MiB/s  {result['ratio_to_read'][name]:5.1f}x read"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
