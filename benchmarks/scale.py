"""Per-rank memory and work at 8 to 8,192 ranks, simulated: one process is one rank of N under torch's fake process
group (collectives return at once), with a real-size model built on the meta device and the real ``parallelize``.

    python benchmarks/scale.py                                   # every model shape at N = 8 ... 8,192
    python benchmarks/scale.py --models qwen3_235b --worlds 1024,2048
    python benchmarks/scale.py --load --models llama3_70b --worlds 64   # also from_pretrained on a header-only checkpoint

For each model shape, layout, world size N and simulated rank (0 and N-1), a fresh process reports:

- **local / padded bytes**: the rank's parameter shards in the model dtype (bf16), and what FSDP2 allocates for
  them (dim-0 shards are padded to a multiple of the group), against the ideal ``total / N``;
- **mesh CPU seconds**: ``MeshContext.build``, nearly all of it torch's ``init_device_mesh`` (on gloo and the fake
  backend it calls ``new_group`` once per subgroup of every mesh dim: O(N); NCCL with a bound device splits);
- **parallelize CPU seconds**, split into torch's ``fully_shard`` and the project's own part (everything else);
- **load planning CPU seconds**: ``local_indices`` for every parameter, the indices the loader reads;
- **export writers CPU seconds**: ``assign_writers`` over the whole state dict, who writes which box of the
  parallel export (decided from placements, one all-reduce of one integer per tensor);
- **peak RSS** of the process.

With ``--load``, ``from_pretrained`` also runs on a header-only safetensors checkpoint (real headers and index, a
sparse file with no data: reads return zeros without touching a disk; its pages are dropped from the page cache
before each load, so every load starts cold) and reports its wall time, its peak RSS growth
and CPU time (user + system: the kernel's page-cache work is charged to the reading process), its peak RSS growth
against the local shards, and the same rank's load under FSDP2 alone (the reference the TP load is held to). A
model is loaded after its parallelize run in the same process, so imports are outside the load's span.

Figures that should not grow with N (per-rank load planning, export writers, the project's parallelize time and torch's
``fully_shard`` time under the project's shims, padded / ideal bytes) are flagged when the largest N's value exceeds
twice the smallest's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes

# name -> (config class, config kwargs, layouts)
MODELS: dict[str, tuple[str, dict, dict[str, dict]]] = {
    "llama3_70b": (
        "LlamaConfig",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        {"fsdp2_tp8": {"strategy": "fsdp2", "tp_size": 8}, "fsdp2": {"strategy": "fsdp2"}},
    ),
    "qwen3_235b": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=4096,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=1536,
            intermediate_size=12288,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
        ),
        {"ep64": {"strategy": "fsdp2", "ep_size": 64}, "ep64_tp4": {"strategy": "fsdp2", "ep_size": 64, "tp_size": 4}},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            first_k_dense_replace=3,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            vocab_size=129280,
        ),
        {"ep64": {"strategy": "fsdp2", "ep_size": 64}},
    ),
}
WORLDS = (8, 64, 512, 1024, 4096, 8192)
GROWTH_LIMIT = 2.0


def _config(model: str):
    import transformers

    class_name, kwargs, _ = MODELS[model]
    return getattr(transformers, class_name)(**kwargs, architectures=None, dtype="bfloat16")


# ----------------------------------------------------------------------------------------------------------------
# One simulated rank (a child process).
# ----------------------------------------------------------------------------------------------------------------


def simulate_rank(model: str, layout: dict, world: int, rank: int, checkpoint: str | None) -> dict:
    """Everything one simulated rank reports (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from automodel._compat.torch import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    import automodel.distributed.fsdp as fsdp_module
    from automodel import NeMoAutoModelForCausalLM
    from automodel._compat.torch import fsdp_param_groups
    from automodel.distributed import MeshContext, ModelParallelizer
    from automodel.loading.initialization import local_view
    from automodel.loading.placements import local_indices

    torch_seconds = [0.0]
    fully_shard = fsdp_module.fully_shard

    def timed_fully_shard(*args, **kwargs):
        start = time.process_time()
        try:
            return fully_shard(*args, **kwargs)
        finally:
            torch_seconds[0] += time.process_time() - start

    fsdp_module.fully_shard = timed_fully_shard
    config = _config(model)
    with torch.device("meta"):
        meta = NeMoAutoModelForCausalLM._build_on_meta(config, torch.bfloat16, None, False)
    total = sum(param.numel() * param.element_size() for param in meta.parameters())
    # Each timed span starts after a full collection: with a 70B model on meta in memory one takes 0.25 s, and it
    # falls in whichever span passes the collector's threshold, not in the one that made the objects.
    gc.collect()
    start = time.process_time()
    context = MeshContext.build(**layout)
    mesh = time.process_time() - start
    gc.collect()
    start = time.process_time()
    parallel = ModelParallelizer().parallelize(meta, context)
    parallelize = time.process_time() - start
    local = sum(local_view(p).numel() * p.element_size() for p in parallel.parameters())
    padded = _padded_bytes(parallel, fsdp_param_groups)
    gc.collect()
    start = time.process_time()
    for param in parallel.parameters():
        local_indices(param)
    planning = time.process_time() - start
    from automodel.loading.region_writes import assign_writers

    state = parallel.state_dict()
    gc.collect()
    start = time.process_time()
    writes, _ = assign_writers(sorted(state), state)
    writers = time.process_time() - start
    result = {
        "model": model,
        "world": world,
        "rank": rank,
        "total_bytes": total,
        "local_bytes": local,
        "padded_bytes": padded,
        "ideal_bytes": total / world,
        "mesh_s": mesh,
        "parallelize_s": parallelize,
        "torch_fully_shard_s": torch_seconds[0],
        "project_parallelize_s": parallelize - torch_seconds[0],
        "load_planning_s": planning,
        "export_writers_s": writers,
        "export_boxes": len(writes),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    del parallel, meta
    if checkpoint:
        result.update(_load(checkpoint, layout))
    return result


def _padded_bytes(model, fsdp_param_groups) -> int:
    """Bytes FSDP2 allocates for this rank's shards (its padded sharded storage), plus the parameters FSDP2 does
    not manage."""
    from torch.distributed.fsdp import FSDPModule

    managed, padded = set(), 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            for fsdp_param in group.fsdp_params:
                if id(fsdp_param) in managed:
                    continue
                managed.add(id(fsdp_param))
                data = fsdp_param._sharded_param_data
                padded += data.numel() * data.element_size()
                managed.add(id(fsdp_param.sharded_param))
    for param in model.parameters():
        if id(param) not in managed:
            local = param.to_local() if hasattr(param, "to_local") else param
            padded += local.numel() * local.element_size()
    return padded


def _load(checkpoint: str, layout: dict) -> dict:
    """``from_pretrained`` of the header-only checkpoint: wall time, peak RSS growth, local shard bytes."""
    import torch

    from automodel import NeMoAutoModelForCausalLM
    from automodel.distributed import MeshContext
    from automodel.loading.initialization import local_view

    context = MeshContext.build(**layout)
    _evict_from_page_cache(Path(checkpoint))
    gc.collect()
    reset_peak_rss()
    before = rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.bfloat16)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    growth = peak_rss_bytes() - before
    local = sum(local_view(p).numel() * p.element_size() for p in model.parameters())
    return {"load_s": seconds, "load_cpu_s": cpu, "load_rss_growth_bytes": growth, "load_local_bytes": local}


def _evict_from_page_cache(checkpoint: Path) -> None:
    """Drop the checkpoint files' pages from the page cache (``posix_fadvise(DONTNEED)``, no privileges needed), so
    that each load starts cold, whatever the one before it read: a hole read for the first time costs a page filled
    with zeros, and a layout that reads more pages (row bands) pays for them in every run alike."""
    for path in checkpoint.glob("*.safetensors"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


# ----------------------------------------------------------------------------------------------------------------
# Header-only checkpoints.
# ----------------------------------------------------------------------------------------------------------------


def header_only_checkpoint(model: str, directory: Path, shard_bytes: int = 5 << 30) -> Path:
    """A checkpoint of ``model`` with real headers, index and config, whose data is a hole: each shard file is
    truncated to its full size without writing it (skipped if present)."""
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    import torch

    from automodel import NeMoAutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = _config(model)
    meta = NeMoAutoModelForCausalLM._build_on_meta(config, torch.bfloat16, None, False)
    names = {"torch.bfloat16": "BF16", "torch.float32": "F32"}
    shards: list[list[tuple[str, list[int], str, int]]] = [[]]
    size = 0
    for name, tensor in meta.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, list(tensor.shape), names[str(tensor.dtype)], nbytes))
        size += nbytes
    weight_map = {}
    for index, entries in enumerate(shards):
        filename = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape, dtype, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = filename
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / filename, "wb") as stream:
            stream.write(struct.pack("<Q", len(encoded)) + encoded)
            stream.truncate(8 + len(encoded) + offset)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.architectures = [type(meta).__name__]
    config.save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------------------------------------------
# The driver.
# ----------------------------------------------------------------------------------------------------------------


def run_case(model: str, layout_name: str, world: int, rank: int, checkpoint: Path | None) -> dict:
    layout = MODELS[model][2][layout_name]
    command = [sys.executable, __file__, "--case", json.dumps([model, layout, world, rank, str(checkpoint or "")])]
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode != 0 or not lines:
        return {"model": model, "world": world, "rank": rank, "error": completed.stderr.strip().splitlines()[-1:]}
    return {**json.loads(lines[-1]), "layout": layout_name}


def print_header() -> None:
    print(
        f"{'model':12s} {'layout':9s} {'N':>5s} {'rank':>5s} {'local MiB':>10s} {'padded MiB':>10s} {'ideal MiB':>9s} "
        f"{'padded/ideal':>12s} {'mesh s':>7s} {'parallelize s':>13s} {'torch s':>8s} {'ours s':>7s} {'plan s':>7s} "
        f"{'writers s':>9s} {'RSS MiB':>8s}"
    )


def print_rows(rows: list[dict]) -> None:
    mib = 2**20
    for row in rows:
        if "error" in row:
            print(
                f"{row['model']:12s} {row.get('layout', ''):9s} {row['world']:5d} {row['rank']:5d} error: {row['error']}"
            )
            continue
        print(
            f"{row['model']:12s} {row['layout']:9s} {row['world']:5d} {row['rank']:5d} {row['local_bytes'] / mib:10.0f} "
            f"{row['padded_bytes'] / mib:10.0f} {row['ideal_bytes'] / mib:9.0f} "
            f"{row['padded_bytes'] / row['ideal_bytes']:12.2f} {row['mesh_s']:7.2f} {row['parallelize_s']:13.2f} "
            f"{row['torch_fully_shard_s']:8.2f} {row['project_parallelize_s']:7.2f} {row['load_planning_s']:7.3f} "
            f"{row['export_writers_s']:9.3f} {row['peak_rss_bytes'] / mib:8.0f}"
        )
        if "load_s" in row:
            print(
                f"{'':34s} load: {row['load_s']:.2f} s ({row['load_cpu_s']:.2f} s CPU), peak RSS growth {row['load_rss_growth_bytes'] / mib:.0f} MiB "
                f"for {row['load_local_bytes'] / mib:.0f} MiB of local shards "
                f"({row['load_rss_growth_bytes'] / max(row['load_local_bytes'], 1):.2f}x)"
            )


def flag_growth(rows: list[dict]) -> list[str]:
    """Per (model, layout, rank position): the figures whose value at the largest N exceeds ``GROWTH_LIMIT`` times
    the smallest N's."""
    flags = []
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "error" not in row:
            groups.setdefault((row["model"], row["layout"], row["rank"] == 0), []).append(row)
    for (model, layout, first), group in groups.items():
        group.sort(key=lambda row: row["world"])
        small, large = group[0], group[-1]
        if small is large:
            continue
        for key in ("project_parallelize_s", "torch_fully_shard_s", "load_planning_s", "export_writers_s"):
            if large[key] > GROWTH_LIMIT * max(small[key], 0.05):
                flags.append(
                    f"{model} {layout} rank {'0' if first else 'N-1'}: {key} {small[key]:.2f} s at "
                    f"N={small['world']} -> {large[key]:.2f} s at N={large['world']}"
                )
        ratio = large["padded_bytes"] / large["ideal_bytes"]
        if ratio > 1.1:
            flags.append(f"{model} {layout} N={large['world']}: padded bytes {ratio:.2f}x the ideal")
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default="", help="comma-separated layout names (default: every layout)")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--load", action="store_true", help="also from_pretrained on a header-only checkpoint")
    parser.add_argument("--checkpoints", default="/tmp/automodel-scale-checkpoints")
    parser.add_argument("--json", default="", help="write the rows to this file")
    parser.add_argument("--ranks", default="first,last", help="simulated ranks: first, last, or numbers")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        model, layout, world, rank, checkpoint = json.loads(args.case)
        print(json.dumps(simulate_rank(model, layout, world, rank, checkpoint or None)))
        return
    rows = []
    print_header()
    for model in args.models.split(","):
        checkpoint = header_only_checkpoint(model, Path(args.checkpoints) / model) if args.load else None
        layouts = [name for name in MODELS[model][2] if not args.layouts or name in args.layouts.split(",")]
        for layout_name in layouts:
            for world in map(int, args.worlds.split(",")):
                layout = MODELS[model][2][layout_name]
                divisor = math.lcm(layout.get("tp_size", 1), layout.get("ep_size", 1))
                if world % divisor or world < divisor:
                    continue
                named = {"first": 0, "last": world - 1}
                for rank in sorted({named.get(r, None) if r in named else int(r) for r in args.ranks.split(",")}):
                    row = run_case(model, layout_name, world, rank, checkpoint)
                    rows.append(row)
                    print_rows([row])
                    sys.stdout.flush()
    print()
    flags = flag_growth(rows)
    print("\n".join(["Figures that grow with N:", *flags]) if flags else "No figure grows with N.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
