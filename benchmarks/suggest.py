"""``automodel plan --suggest`` at the known points: wall time, how many layouts each pass kept, and the suggestions
(config-only folders, no weights; 80 GiB GPUs in nodes of 8 unless told otherwise).

    python benchmarks/suggest.py                                   # 8B@8, 70B@64, 70B@1024, Qwen3-235B@256, 70B@8x24GiB
    python benchmarks/suggest.py --points 70b@1024

Each line: the point, the wall time of the whole search (the model's facts, the size rules, the memory bound and
the cost model over every layout, and the real plans of the survivors nearest the top), the 1-minute load average
before and after (this machine is shared: the time is an upper bound when it is high), and the counts; then the table.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from plan import config_folder
from scale import MODELS

GIB = 2**30
MODELS.setdefault(
    "llama3_8b",
    (
        "LlamaConfig",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256),
        {},
    ),
)  # fmt: skip
#: name -> (model, world size, GPU memory in GiB)
POINTS = {
    "8b@8": ("llama3_8b", 8, 80),
    "70b@64": ("llama3_70b", 64, 80),
    "70b@1024": ("llama3_70b", 1024, 80),
    "qwen3_235b@256": ("qwen3_235b", 256, 80),
    "70b@8x24GiB": ("llama3_70b", 8, 24),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--configs", default="/tmp/automodel-plan-configs")
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    from automodel.suggestion import suggest

    for point in args.points.split(","):
        model, world, memory = POINTS[point]
        folder = config_folder(model, Path(args.configs))
        before = os.getloadavg()[0]
        start = time.perf_counter()
        found = suggest(folder, world_size=world, gpu_memory=memory * GIB, nproc_per_node=8, seq_len=args.seq_len)
        wall = time.perf_counter() - start
        print(
            f"{point}: {wall:.1f} s (load {before:.1f} -> {os.getloadavg()[0]:.1f}); layouts {found.counts}",
            flush=True,
        )
        print(found.table(), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
