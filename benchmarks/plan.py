"""``automodel.plan`` at scale: wall time, time per simulated rank and peak memory against the world size, for the
model shapes of ``benchmarks/scale.py`` given as config-only folders (no weights at all).

    python benchmarks/plan.py                                  # Llama-3-70B FSDP2 x TP=8 at 8 ... 8,192 ranks
    python benchmarks/plan.py --model qwen3_235b --layout ep64 --worlds 1024
    python benchmarks/plan.py --model qwen3_235b --layout ep64_tp4 --worlds 1024

Each line: the plan's wall time, the seconds and peak RSS of each simulated rank (its own process), how many rank
classes it found, and ``param_bytes x N`` summed over the classes against ``total_param_bytes`` (the difference is
the padding the plan itself reports: ``padded_param_bytes``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from scale import MODELS, _config

WORLDS = (8, 64, 512, 1024, 4096, 8192)


def config_folder(model: str, root: Path) -> Path:
    """A folder holding only ``model``'s config.json."""
    folder = root / model
    if not (folder / "config.json").is_file():
        config = _config(model)
        config.architectures = None
        config.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_70b", choices=list(MODELS))
    parser.add_argument("--layout", default="", help="a layout name of benchmarks/scale.py (default: the first)")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--configs", default="/tmp/automodel-plan-configs")
    args = parser.parse_args()
    from automodel.planning import plan

    layouts = MODELS[args.model][2]
    name = args.layout or next(iter(layouts))
    folder = config_folder(args.model, Path(args.configs))
    print(f"{args.model} {name} {layouts[name]}")
    print(
        f"{'N':>6s} {'wall s':>7s} {'ranks':>5s} {'classes':>7s} {'s / rank':>16s} {'peak RSS MiB':>16s} "
        f"{'sum(param x members) / total':>29s} {'padded / total':>14s}"
    )
    for world in map(int, args.worlds.split(",")):
        start = time.perf_counter()
        result = plan(folder, world_size=world, layout=layouts[name], dtype="bf16")
        wall = time.perf_counter() - start
        if not result.ok:
            print(f"{world:6d} refused: {result.error}")
            continue
        members = {
            r.rank: (len(r.stands_for) if isinstance(r.stands_for, list) else int(r.stands_for.split()[0]))
            for r in result.ranks
        }
        # Ranks shown twice (rank 0 and the last rank in one class) count once.
        counted = {}
        for r in result.ranks:
            key = str(r.stands_for)
            counted.setdefault(key, (r.param_bytes * members[r.rank], r.padded_param_bytes * members[r.rank]))
        held = sum(value[0] for value in counted.values())
        padded = sum(value[1] for value in counted.values())
        seconds = "/".join(f"{cost['seconds']:.1f}" for cost in result.simulation)
        rss = "/".join(f"{cost['peak_rss_bytes'] / 2**20:.0f}" for cost in result.simulation)
        print(
            f"{world:6d} {wall:7.1f} {len(result.ranks):5d} {len(counted):7d} {seconds:>16s} {rss:>16s} "
            f"{held / result.total_param_bytes:29.4f} {padded / result.total_param_bytes:14.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
