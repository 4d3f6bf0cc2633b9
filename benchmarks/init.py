"""``from_config`` host memory and time per rank: the default (module by module into the local shards) vs
``init="exact"`` (one full copy per rank, transformers' RNG stream), on N CPU ranks, in one run.

    python benchmarks/init.py --nproc 4 --size-gb 1.0

A Llama config of about ``--size-gb`` GB in fp32 (untied, hidden 1024, vocabulary 32000). For each mode N fresh gloo
ranks run ``NeMoAutoModelForCausalLM.from_config(config, mesh_context=MeshContext.build("fsdp2"), seed=0)`` and report:

- **time**: the ``from_config`` call (imports, process group and mesh set up before it);
- **peak growth**: the rank's peak resident memory during the call minus its resident memory before it (the kernel's
  peak counter is reset right before the call);
- the two yardsticks, computed from the model's shapes: the rank's **local shards** plus the **largest single
  module** (its own tensors, full size) — the bound of the default mode — and the **full model**, which ``exact``
  holds once per rank.

The report gives each mode's worst rank and its ratios to both yardsticks.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from _ranks import init_rank, run_ranks

MODES = ("per_module", "exact")


def llama_config(size_gb: float):
    """An untied fp32 Llama of about ``size_gb`` GB (the shape ``benchmarks/load.py`` saves)."""
    from transformers import AutoConfig

    hidden, intermediate, vocab = 1024, 4096, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate
    layers = max(1, round((size_gb * 1e9 / 4 - 2 * vocab * hidden) / per_layer))
    return AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )


def _module_bytes(model) -> tuple[int, int]:
    """The largest module's own tensors and the whole model, in bytes (from shapes; works on meta)."""
    largest = 0
    for module in model.modules():
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        largest = max(largest, sum(t.numel() * t.element_size() for t in own))
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return largest, total


def _rank_main(rank: int, world: int, rendezvous: str, mode: str, size_gb: float, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports stay outside the timed span)
    from torch.distributed.tensor import DTensor

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    config = llama_config(size_gb)
    context = MeshContext.build("fsdp2")
    with torch.device("meta"):
        largest, total = _module_bytes(transformers.AutoModelForCausalLM.from_config(config))
    dist.barrier()
    before = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    model = NeMoAutoModelForCausalLM.from_config(config, mesh_context=context, seed=0, init=mode)
    seconds = time.perf_counter() - start
    growth = peak_rss_bytes() - before
    local = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in [*model.parameters(), *model.buffers()])
    results.put((rank, {"seconds": seconds, "growth": growth, "local": local, "largest": largest, "total": total}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode; the median is reported")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()

    rows = {}
    for mode in args.modes.split(","):
        runs = [run_ranks(_rank_main, args.nproc, mode, args.size_gb) for _ in range(args.repeats)]
        worst = [max(runs_rank, key=lambda row: row["growth"]) for runs_rank in runs]
        rows[mode] = {
            "seconds": statistics.median(max(row["seconds"] for row in run) for run in runs),
            "growth": statistics.median(row["growth"] for row in worst),
            "local": worst[0]["local"],
            "largest": worst[0]["largest"],
            "total": worst[0]["total"],
        }
    first = next(iter(rows.values()))
    mib = 2**20
    print(
        f"model {first['total'] / 1e9:.2f} GB fp32 ({first['total'] / mib:.0f} MiB), {args.nproc} CPU ranks, FSDP2; "
        f"largest module {first['largest'] / mib:.0f} MiB, local shards {first['local'] / mib:.0f} MiB per rank"
    )
    print(f"{'init':<12}{'time (s)':>10}{'peak growth (MiB)':>20}{'x (shards + module)':>22}{'x full model':>14}")
    for mode, row in rows.items():
        bound = row["local"] + row["largest"]
        print(
            f"{mode:<12}{row['seconds']:>10.2f}{row['growth'] / mib:>20.0f}{row['growth'] / bound:>22.2f}"
            f"{row['growth'] / row['total']:>14.2f}"
        )


if __name__ == "__main__":
    main()
