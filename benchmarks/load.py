"""Load-time and host-memory benchmark: this project vs transformers vs a copying floor, on N CPU ranks, in one run.

    python benchmarks/load.py --nproc 4 --size-gb 1.0 --repeats 3
    python benchmarks/load.py --nproc 4 --sweep 0.5,1,2 --repeats 3     # time against checkpoint size
    python benchmarks/load.py --nproc 4 --shape llama3-3b --tp 2 --contenders floor,automodel   # bf16, FSDP2 x TP=2

Generates (once per size) a random fp32 Llama checkpoint of about ``--size-gb`` GB in 500 MB safetensors shards (or,
with ``--shape llama3-3b``, a Llama-3.2-3B-shaped bf16 one, 6.4 GB; ``--tp`` loads it under FSDP2 x TP),
warms the page cache, then for each contender starts N fresh gloo ranks and measures, on every rank:

- **time**: the load call plus one read of every page of every local shard (so a lazy, memory-mapped load pays its
  I/O inside the timing); imports, process-group and mesh setup are outside it;
- **CPU time**: the process's user + system CPU seconds over the same span (page faults included). On a machine
  where ranks share cores with each other and with other work, wall time also measures the neighbours; CPU time
  is the work the rank itself did, and its ratios are the stable ones;
- **peak host memory growth**: the peak resident set size during that span minus the resident size before it (the
  kernel's peak counter is reset right before the span, so pages a lazy load maps in are counted too);
- **disk reads**: bytes the span read from the block device (``ru_inblock``): nonzero means the page cache was not
  warm after all (memory pressure from other processes evicted the checkpoint), and that run's time is I/O-bound.

Contenders:

- ``floor``, the copying floor: each rank reads its 1/N of every tensor (FSDP2's dim-0 chunk, one contiguous region
  of the file) into freshly allocated memory with one positioned read (``os.preadv``) per region, after parsing
  the files' headers: the least any loader that owns its parameter memory must do;
- ``mmap``: each rank keeps ``safe_open(...).get_slice`` views of its chunks (pages of a private memory map of the
  file; no copy, the memory is not owned) -- the earlier floor, a reference only;
- ``automodel``: ``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))``;
- ``read``: automodel's read path alone (``load_checkpoint``: the reader threads filling the local shards, the init of
  what the checkpoint lacks, the agreement between ranks), the model built, checked, parallelized and materialized
  before the span;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N))``.

The report gives each contender's worst rank (the median over ``--repeats`` runs) and its ratio to the copying floor
measured in the same run. With ``--sweep`` every size is measured and each contender's time is fitted as
``fixed + per_gb x size`` (least squares), with the largest deviation of a measured point from the line.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import struct
import time
from pathlib import Path

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from _ranks import init_rank, run_ranks

CONTENDERS = ("floor", "mmap", "automodel", "read", "transformers")
_MAX_READ = 1 << 30  # preadv moves at most ~2 GiB per call on Linux


def make_checkpoint(directory: Path, size_gb: float) -> Path:
    """A random fp32 Llama of about ``size_gb`` GB, saved in 500 MB safetensors shards (skipped if present)."""
    if (directory / "config.json").is_file() and _shard_files(directory):
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


def _shard_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _load_copying_floor(directory: Path):
    """Each rank's dim-0 chunk of every tensor, read with one ``os.preadv`` into a fresh tensor."""
    import torch
    import torch.distributed as dist

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {}
    for path in _shard_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                shape, dtype = entry["shape"], dtypes[entry["dtype"]]
                rows = shape[0] if shape else 1
                chunk = -(-rows // world)
                lo, hi = min(rows, rank * chunk), min(rows, (rank + 1) * chunk)
                out = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
                row_bytes = out[0].numel() * out.element_size() if hi > lo else 0
                view = memoryview(out.view(-1).view(torch.uint8).numpy())
                offset = 8 + length + entry["data_offsets"][0] + lo * row_bytes
                done = 0
                while done < view.nbytes:
                    done += os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
                shards[key] = out
        finally:
            os.close(fd)
    return shards


def _load_mmap_views(directory: Path):
    import torch.distributed as dist
    from safetensors import safe_open

    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {}
    for path in _shard_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_slice(key)
                rows = tensor.get_shape()[0]
                chunk = -(-rows // world)
                shards[key] = tensor[rank * chunk : min(rows, (rank + 1) * chunk)]
    return shards


def make_llama3_3b(directory: Path) -> Path:
    """A random Llama-3.2-3B-shaped bf16 checkpoint (6.4 GB, tied embeddings) in 2 GB shards (skipped if present)."""
    if (directory / "config.json").is_file() and _shard_files(directory):
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head a tensor of its own
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    model.save_pretrained(directory, max_shard_size="2GB")
    return directory


def _load_automodel(directory: Path):
    from automodel.auto_model import NeMoAutoModelForCausalLM

    return NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=_load_automodel.context, dtype="auto")


def _load_transformers(directory: Path):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = int(os.environ["WORLD_SIZE"])
    return AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(fsdp_size=world), dtype="auto"
    )


def _prepare_read(directory: Path):
    """Everything of automodel's load before its read path: build on meta, check the checkpoint, parallelize,
    materialize the local shards (outside the timed span of the ``read`` contender)."""
    import torch
    from transformers import AutoConfig

    from automodel.auto_model import NeMoAutoModelForCausalLM
    from automodel.distributed.parallelizer import parallelizer_for
    from automodel.loading.loader import materialize, plan_checkpoint

    config = AutoConfig.from_pretrained(directory)
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype or torch.float32
    model = NeMoAutoModelForCausalLM._build_on_meta(config, dtype, None, False)
    plan = plan_checkpoint(model, directory)
    model = parallelizer_for(model).parallelize(model, _load_automodel.context)
    allocated = materialize(model, "cpu")
    return model, plan, allocated


def _load_automodel_read(directory: Path, prepared):
    """automodel's read path alone: ``load_checkpoint`` (the reads, the init of what the checkpoint lacks, the
    agreement between ranks) into the model ``_prepare_read`` made."""
    from automodel.loading.loader import load_checkpoint

    model, plan, allocated = prepared
    load_checkpoint(model, plan, progress=False, allocated=allocated)
    return model


LOADERS = {
    "floor": _load_copying_floor,
    "mmap": _load_mmap_views,
    "automodel": _load_automodel,
    "read": _load_automodel_read,
    "transformers": _load_transformers,
}


def _local_tensors(loaded):
    from torch.distributed.tensor import DTensor

    if isinstance(loaded, dict):
        return list(loaded.values())
    return [p.to_local() if isinstance(p, DTensor) else p for p in [*loaded.parameters(), *loaded.buffers()]]


def _rank_main(
    rank: int, world: int, rendezvous: str, contender: str, directory: str, tp_size: int, profile: bool, results
) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist

    # Imports stay outside the timed span, the model's own modeling module included.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.distributed import DistributedConfig  # noqa: F401

    from automodel import MeshContext
    from automodel.auto_model import NeMoAutoModelForCausalLM  # noqa: F401

    automodel = contender in ("automodel", "read")
    _load_automodel.context = MeshContext.build("fsdp2", tp_size=tp_size) if automodel else None
    prepared = _prepare_read(Path(directory)) if contender == "read" else None
    dist.barrier()
    before = rss_bytes()
    reset_peak_rss()
    blocks = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
    profiler = _start_profile() if profile and rank == 0 else None
    start, cpu_start = time.perf_counter(), time.process_time()
    loaded = LOADERS[contender](Path(directory), *([prepared] if prepared else []))
    if profiler is not None:
        profiler.disable()
    with torch.no_grad():
        # Every 1,024th element: one per page or more, so a lazy (memory-mapped) load pays for all its pages, without
        # a full-size float copy of the largest tensor in the peak memory (a bf16 tensor's sum upcasts it).
        checksum = sum(float(t.reshape(-1)[::1024].sum(dtype=torch.float32)) for t in _local_tensors(loaded))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = peak_rss_bytes()
    disk = (resource.getrusage(resource.RUSAGE_SELF).ru_inblock - blocks) * 512
    local_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(loaded))
    results.put((rank, (seconds, peak - before, local_bytes, checksum, cpu, disk, _profile_text(profiler))))
    dist.barrier()
    dist.destroy_process_group()


def _start_profile():
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _profile_text(profiler, top: int = 40) -> str | None:
    """Rank 0's load under ``cProfile``: the functions with the most time of their own and the most time in all."""
    if profiler is None:
        return None
    import io
    import pstats

    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return stream.getvalue()


def measure(
    directory: Path, contenders: list[str], world: int, repeats: int, tp_size: int = 1, profile: bool = False
) -> dict[str, dict[str, float]]:
    """Each contender's worst rank, median over ``repeats`` runs (contenders interleaved run by run, so that a burst
    of load on the machine hits all of them alike)."""
    runs: dict[str, list[list[tuple]]] = {contender: [] for contender in contenders}
    for _ in range(repeats):
        for contender in contenders:
            _warm_page_cache(directory)
            runs[contender].append(run_ranks(_rank_main, world, contender, str(directory), tp_size, profile))
            if profile and runs[contender][-1][0][6]:
                print(f"--- {contender}, rank 0 under cProfile ---\n{runs[contender][-1][0][6]}", flush=True)
    return {
        contender: {
            "seconds": statistics.median(max(row[0] for row in run) for run in rows),
            "peak_growth": statistics.median(max(row[1] for row in run) for run in rows),
            "local_bytes": max(row[2] for row in rows[0]),
            "cpu": statistics.median(max(row[4] for row in run) for run in rows),
            "disk": max(row[5] for run in rows for row in run),
        }
        for contender, rows in runs.items()
    }


def print_table(measured: dict[str, dict[str, float]]) -> None:
    floor = measured.get("floor")
    print(
        f"{'contender':<14}{'time (s)':>10}{'x floor':>9}{'cpu (s)':>9}{'x floor':>9}{'peak growth (MiB)':>19}"
        f"{'x floor':>9}{'local (MiB)':>13}{'disk (MiB)':>12}"
    )
    for contender, row in measured.items():

        def ratio(key: str, row: dict = row) -> float:
            return row[key] / floor[key] if floor else float("nan")

        print(
            f"{contender:<14}{row['seconds']:>10.2f}{ratio('seconds'):>9.2f}{row['cpu']:>9.2f}{ratio('cpu'):>9.2f}"
            f"{row['peak_growth'] / 2**20:>19.0f}{ratio('peak_growth'):>9.2f}{row['local_bytes'] / 2**20:>13.0f}"
            f"{row['disk'] / 2**20:>12.0f}",
            flush=True,
        )


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float, float]:
    """Least-squares ``seconds = fixed + per_gb * size``; returns (fixed, per_gb, largest residual)."""
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((x - mean_x) ** 2 for x in sizes)
    per_gb = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / spread
    fixed = mean_y - per_gb * mean_x
    residual = max(abs(y - (fixed + per_gb * x)) for x, y in zip(sizes, seconds, strict=True))
    return fixed, per_gb, residual


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--sweep", help="comma-separated sizes in GB (e.g. 0.5,1,2): measure each and fit a line")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")), help="checkpoints' parent")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender; the median is reported")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--shape", choices=["llama", "llama3-3b"], default="llama", help="llama: fp32, --size-gb")
    parser.add_argument("--tp", type=int, default=1, help="automodel's tp_size (FSDP2 x TP)")
    parser.add_argument("--profile", action="store_true", help="print rank 0's load under cProfile (each run)")
    args = parser.parse_args()
    contenders = args.contenders.split(",")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}: choose from {', '.join(CONTENDERS)}")
    sizes = [float(size) for size in args.sweep.split(",")] if args.sweep else [args.size_gb]

    by_size: dict[float, dict[str, dict[str, float]]] = {}
    if args.shape == "llama3-3b":
        sizes = [0.0]
    for size_gb in sizes:
        if args.shape == "llama3-3b":
            directory = make_llama3_3b(args.dir / "automodel-load-bench-llama3-3b")
        else:
            directory = make_checkpoint(args.dir / f"automodel-load-bench-{size_gb:g}gb", size_gb)
        size = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
        layout = f"FSDP2 x TP={args.tp}" if args.tp > 1 else "FSDP2"
        print(
            f"\ncheckpoint: {directory} ({size / 1e9:.2f} GB), {args.nproc} CPU ranks ({layout}), page cache warm",
            flush=True,
        )
        by_size[size / 1e9] = measure(directory, contenders, args.nproc, args.repeats, args.tp, args.profile)
        print_table(by_size[size / 1e9])
    if len(by_size) < 2:
        return
    sizes_gb = list(by_size)
    print(f"\ntime = fixed + per GB x size (least squares over {', '.join(f'{s:.2f}' for s in sizes_gb)} GB)")
    print(f"{'contender':<14}{'fixed (s)':>10}{'s per GB':>10}{'max dev (s)':>13}  time at each size (s)")
    for contender in contenders:
        points = [by_size[size][contender]["seconds"] for size in sizes_gb]
        fixed, per_gb, residual = fit_line(sizes_gb, points)
        listing = ", ".join(f"{seconds:.2f}" for seconds in points)
        print(f"{contender:<14}{fixed:>10.2f}{per_gb:>10.2f}{residual:>13.2f}  {listing}")
    print(f"\ncpu = fixed + per GB x size (worst rank, s)\n{'contender':<14}{'fixed':>10}{'per GB':>10}{'max dev':>13}")
    for contender in contenders:
        fixed, per_gb, residual = fit_line(sizes_gb, [by_size[size][contender]["cpu"] for size in sizes_gb])
        print(f"{contender:<14}{fixed:>10.3f}{per_gb:>10.3f}{residual:>13.3f}")
    print("\npeak growth = fixed + per GB x size (MiB)")
    print(f"{'contender':<14}{'fixed':>10}{'per GB':>10}{'max dev':>13}  peak growth at each size")
    for contender in contenders:
        points = [by_size[size][contender]["peak_growth"] / 2**20 for size in sizes_gb]
        fixed, per_gb, residual = fit_line(sizes_gb, points)
        listing = ", ".join(f"{mib:.0f}" for mib in points)
        print(f"{contender:<14}{fixed:>10.1f}{per_gb:>10.1f}{residual:>13.1f}  {listing}")


if __name__ == "__main__":
    main()
