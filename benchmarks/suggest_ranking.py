"""Does the layout search's cost model order layouts as they run? Measured step times of a ~100 M Llama on 4 CPU
gloo ranks for several layouts, against the cost model's estimates for the same layouts, with Spearman's rank
correlation (docs/plan.md reports the result).

    python benchmarks/suggest_ranking.py                   # every layout, 1 warm-up + 3 measured steps each
    python benchmarks/suggest_ranking.py --nproc 2              # the 2-rank layouts (one rank per core here)
    python benchmarks/suggest_ranking.py --steps 2 --layouts fsdp4,tp4

CPU gloo is a stand-in for the ordering, not for the constants: the cost model gets this machine's own figures,
measured first on the same 4 ranks at once (a matmul's FLOP/s per rank, a copy's bytes/s, an all-reduce's bus
bytes/s), as the GPU presets give a GPU's, and that gloo's collectives do not overlap compute (they run on the cores that
compute: ``Hardware.overlaps_communication=False``); its other constants (efficiencies, latencies) are the GPU ones.
The estimate with overlap (as on a GPU) is printed beside it. Each
layout starts 4 fresh ranks, builds the model (``from_config``, fp32), and times ``automodel.training``'s
``train_step`` plus an AdamW step on random tokens: 8 sequences of ``--seq`` tokens per step. The step time of a
layout is the median over the measured steps of the slowest rank's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _ranks import init_rank, run_ranks

#: ~100 M parameters: 12 layers of hidden 768 (12 heads, 4 KV heads), MLP 2048, vocabulary 16384, untied.
MODEL = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
    vocab_size=16384, max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip
SEQUENCES = 8
#: world size -> name -> (MeshContext.build keywords, micro batch size, grad_sync)
LAYOUTS = {
    4: {
        "fsdp4": ({}, 2, "step"),
        "fsdp4_accumulate": ({}, 1, "step"),
        "fsdp4_full_ac": ({"activation_checkpointing": "full"}, 2, "step"),
        "hsdp2_fsdp2": ({"dp_replicate_size": 2}, 2, "step"),
        "fsdp2_tp2": ({"tp_size": 2}, 4, "step"),
        "fsdp2_tp2_sp": ({"tp_size": 2, "sequence_parallel": True}, 4, "step"),
        "tp4": ({"tp_size": 4}, 8, "step"),
        "pp2_fsdp2": ({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2}, 2, "step"),
        "pp4": ({"pp_size": 4, "pp_schedule": "1f1b", "pp_microbatches": 4}, 2, "step"),
    },
    2: {
        "fsdp2": ({}, 4, "step"),
        "fsdp2_accumulate": ({}, 1, "step"),
        "fsdp2_micro_sync": ({}, 1, "micro_batch"),
        "fsdp2_full_ac": ({"activation_checkpointing": "full"}, 4, "step"),
        "tp2": ({"tp_size": 2}, 8, "step"),
        "tp2_sp": ({"tp_size": 2, "sequence_parallel": True}, 8, "step"),
        "pp2_m2": ({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2}, 4, "step"),
        "pp2_m8": ({"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 8}, 1, "step"),
    },
}


def _calibrate(rank: int, world: int, rendezvous: str, results) -> None:
    """This machine's rates with every rank working at once: matmul FLOP/s, copy bytes/s, all-reduce bus bytes/s."""
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist

    a, b = torch.randn(1024, 768), torch.randn(768, 2048)
    dist.barrier()
    start, count = time.perf_counter(), 20
    for _ in range(count):
        a @ b
    flops = count * 2 * 1024 * 768 * 2048 / (time.perf_counter() - start)
    source = torch.randn(16 * 2**20 // 4)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        source.clone()
    copy = 10 * 2 * source.numel() * 4 / (time.perf_counter() - start)  # read and write
    tensor = torch.randn(16 * 2**20 // 4)
    dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(tensor)
    seconds = (time.perf_counter() - start) / 5
    bus = 2 * tensor.numel() * 4 * (world - 1) / world / seconds  # ring all-reduce bytes per rank
    results.put((rank, {"flops": flops, "copy": copy, "bus": bus}))
    dist.destroy_process_group()


def _measure(rank: int, world: int, rendezvous: str, folder: str, name: str, seq: int, steps: int, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from automodel import NeMoAutoModelForCausalLM
    from automodel.distributed import MeshContext
    from automodel.training.loop import train_step

    layout, micro, grad_sync = LAYOUTS[world][name]
    context = MeshContext.build("fsdp2", **layout)
    config = AutoConfig.from_pretrained(folder)
    model = NeMoAutoModelForCausalLM.from_config(config, mesh_context=context, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = SEQUENCES // context.dp_size
    generator = torch.Generator().manual_seed(context.mesh("dp").get_local_rank())
    times = []
    for _ in range(1 + steps):
        ids = torch.randint(0, config.vocab_size, (rows, seq), generator=generator)
        batches = [{"input_ids": part, "labels": part} for part in ids.split(micro)]
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        train_step(model, batches, context, grad_sync=grad_sync)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    results.put((rank, times[1:]))
    dist.destroy_process_group()


def _predicted(folder: str, world: int, name: str, seq: int, rates: dict[str, float], overlaps: bool) -> float:
    from automodel.suggestion.candidates import Candidate
    from automodel.suggestion.cost_model import COMPUTE_EFFICIENCY, LINK_EFFICIENCY, CostModel
    from automodel.suggestion.hardware import Hardware
    from automodel.suggestion.memory import MemoryModel
    from automodel.suggestion.search import load_facts, training_setup

    layout, micro, grad_sync = LAYOUTS[world][name]
    pp, replicas, tp = layout.get("pp_size", 1), layout.get("dp_replicate_size", 1), layout.get("tp_size", 1)
    shard = world // (pp * replicas * tp)
    rows = SEQUENCES // (replicas * shard)
    candidate = Candidate(
        pp, replicas, shard, 1, tp, 1, layout.get("sequence_parallel", False),
        layout.get("activation_checkpointing", False), layout.get("pp_schedule", "1f1b"), 1,
        micro if pp == 1 else rows // layout["pp_microbatches"], rows // micro if pp == 1 else layout["pp_microbatches"],
        grad_sync,
    )  # fmt: skip
    gbps = rates["bus"] * 8 / 1e9 / LINK_EFFICIENCY
    machine = Hardware("cpu", 2**40, rates["flops"] / COMPUTE_EFFICIENCY, rates["copy"], gbps, gbps, world, overlaps)
    facts = load_facts(folder, False, "fp32")
    memory = MemoryModel(facts, training_setup({}, "fp32"), seq)
    assert candidate.world_size == world, (name, candidate)
    return CostModel(memory, machine).step_time(candidate).total


def spearman(first: list[float], second: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        index = 0
        while index < len(order):
            end = index
            while end + 1 < len(order) and values[order[end + 1]] == values[order[index]]:
                end += 1
            for position in range(index, end + 1):
                result[order[position]] = (index + end) / 2
            index = end + 1
        return result

    a, b = ranks(first), ranks(second)
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    covariance = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b, strict=True))
    spread = (sum((x - mean_a) ** 2 for x in a) * sum((y - mean_b) ** 2 for y in b)) ** 0.5
    return covariance / spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4, choices=sorted(LAYOUTS))
    parser.add_argument("--layouts", help="a comma-separated subset (default: every layout of --nproc)")
    args = parser.parse_args()
    from transformers import LlamaConfig

    world = args.nproc
    names = args.layouts.split(",") if args.layouts else list(LAYOUTS[world])
    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(**MODEL).save_pretrained(folder)
        calibration = run_ranks(_calibrate, world)
        rates = {key: min(rank[key] for rank in calibration) for key in calibration[0]}
        print(
            f"this machine, {world} ranks at once: {rates['flops'] / 1e9:.1f} GFLOP/s per rank, copy "
            f"{rates['copy'] / 1e9:.1f} GB/s, all-reduce bus {rates['bus'] / 1e9:.2f} GB/s",
            flush=True,
        )
        print(
            f"{'layout':>18s} {'measured s':>11s} {'CPU s (all ranks)':>18s} {'estimated s':>12s} "
            f"{'estimated, overlap':>20s}",
            flush=True,
        )
        measured, cpu, estimated, as_gpu = [], [], [], []
        for name in names:
            per_rank = run_ranks(_measure, world, folder, name, args.seq, args.steps)
            steps = list(zip(*per_rank, strict=True))  # per step: each rank's (wall, CPU) seconds
            measured.append(statistics.median(max(wall for wall, _ in ranks) for ranks in steps))
            cpu.append(statistics.median(sum(seconds for _, seconds in ranks) for ranks in steps))
            estimated.append(_predicted(str(Path(folder)), world, name, args.seq, rates, overlaps=False))
            as_gpu.append(_predicted(str(Path(folder)), world, name, args.seq, rates, overlaps=True))
            print(
                f"{name:>18s} {measured[-1]:11.2f} {cpu[-1]:18.2f} {estimated[-1]:12.2f} {as_gpu[-1]:20.2f}", flush=True
            )
    print(f"Spearman rho, estimated vs measured step time ({len(names)} layouts): {spearman(estimated, measured):.2f}")
    print(f"... with communication overlapping compute as on a GPU: {spearman(as_gpu, measured):.2f}")
    print(f"Spearman rho, measured step time vs the ranks' CPU seconds: {spearman(measured, cpu):.2f}")


if __name__ == "__main__":
    main()
