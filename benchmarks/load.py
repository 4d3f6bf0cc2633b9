"""Load-time and host-memory benchmark: this project vs transformers vs the floor, on N CPU ranks, in one run.

    python benchmarks/load.py --nproc 4 --size-gb 1.0

Generates (once) a random Llama checkpoint of about ``--size-gb`` GB in safetensors shards, warms the page cache,
then for each contender starts N fresh gloo ranks and measures, on every rank:

- **time**: the load call plus one read of every local shard (so a lazy, memory-mapped load pays its I/O inside the
  timing); imports, process-group and mesh setup are outside it;
- **peak host memory growth**: the peak resident set size during that span minus the resident size before it (the
  kernel's peak counter is reset right before the span, so pages a lazy load maps in are counted too).

Contenders:

- ``floor``: each rank reads only its 1/N of every tensor (``safe_open(...).get_slice``, dim-0 chunks) and keeps it;
- ``automodel``: ``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))``;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N))``.

The report gives each contender's worst rank and its ratio to the floor measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

CONTENDERS = ("floor", "automodel", "transformers")


def _rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def make_checkpoint(directory: Path, size_gb: float) -> Path:
    """A random fp32 Llama of about ``size_gb`` GB, saved in 500 MB safetensors shards (skipped if present)."""
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, intermediate, vocab = 1024, 4096, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate
    layers = max(1, round((size_gb * 1e9 / 4 - 2 * vocab * hidden) / per_layer))
    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, max_shard_size="500MB")
    return directory


def _warm_page_cache(directory: Path) -> None:
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as stream:
            while stream.read(64 << 20):
                pass


def _load_floor(directory: Path):
    import torch.distributed as dist
    from safetensors import safe_open

    rank, world = dist.get_rank(), dist.get_world_size()
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {}
    for filename in sorted(set(weight_map.values())):
        with safe_open(str(directory / filename), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                rows = tensor.get_shape()[0]
                chunk = -(-rows // world)
                shards[key] = tensor[rank * chunk : min(rows, (rank + 1) * chunk)]
    return shards


def _load_automodel(directory: Path):
    from automodel.auto_model import NeMoAutoModelForCausalLM

    context = _load_automodel.context
    return NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, dtype="auto")


def _load_transformers(directory: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = int(os.environ["WORLD_SIZE"])
    return AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(fsdp_size=world), dtype=torch.float32
    )


def _local_tensors(loaded):
    from torch.distributed.tensor import DTensor

    if isinstance(loaded, dict):
        return list(loaded.values())
    return [p.to_local() if isinstance(p, DTensor) else p for p in [*loaded.parameters(), *loaded.buffers()]]


def _rank_main(rank: int, world: int, port: int, contender: str, directory: str, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=20))
    # Imports stay outside the timed span, the model's own modeling module included.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401

    from automodel import MeshContext
    from automodel.auto_model import NeMoAutoModelForCausalLM  # noqa: F401

    _load_automodel.context = MeshContext.build("fsdp2") if contender == "automodel" else None
    loader = {"floor": _load_floor, "automodel": _load_automodel, "transformers": _load_transformers}[contender]
    dist.barrier()
    before = _rss_bytes()
    _reset_peak_rss()
    start = time.perf_counter()
    loaded = loader(Path(directory))
    with torch.no_grad():
        checksum = sum(float(tensor.float().sum()) for tensor in _local_tensors(loaded))
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    local_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(loaded))
    results.put((rank, seconds, peak - before, local_bytes, checksum))
    dist.barrier()
    dist.destroy_process_group()


def run_contender(contender: str, directory: Path, world: int) -> dict:
    """Start ``world`` fresh ranks for ``contender``; return its per-rank measurements."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, contender, str(directory), results))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    rows = [results.get(timeout=1800) for _ in range(world)]
    for process in processes:
        process.join(timeout=60)
    rows.sort()
    return {
        "seconds": [row[1] for row in rows],
        "peak_growth": [row[2] for row in rows],
        "local_bytes": [row[3] for row in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "automodel-load-bench")
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender; the median is reported")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    args = parser.parse_args()

    directory = make_checkpoint(args.dir, args.size_gb)
    size = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    print(f"checkpoint: {directory} ({size / 1e9:.2f} GB), {args.nproc} CPU ranks, page cache warm")
    measured = {}
    for contender in args.contenders.split(","):
        runs = []
        for _ in range(args.repeats):
            _warm_page_cache(directory)
            runs.append(run_contender(contender, directory, args.nproc))
        measured[contender] = {
            "seconds": statistics.median(max(run["seconds"]) for run in runs),
            "peak_growth": statistics.median(max(run["peak_growth"]) for run in runs),
            "local_bytes": max(runs[0]["local_bytes"]),
        }
    floor = measured.get("floor")
    print(f"{'contender':<14}{'time (s)':>10}{'x floor':>9}{'peak growth (MiB)':>20}{'x floor':>9}{'local (MiB)':>13}")
    for contender, row in measured.items():
        time_ratio = row["seconds"] / floor["seconds"] if floor else float("nan")
        memory_ratio = row["peak_growth"] / floor["peak_growth"] if floor else float("nan")
        print(
            f"{contender:<14}{row['seconds']:>10.2f}{time_ratio:>9.2f}{row['peak_growth'] / 2**20:>20.0f}"
            f"{memory_ratio:>9.2f}{row['local_bytes'] / 2**20:>13.0f}"
        )


if __name__ == "__main__":
    main()
