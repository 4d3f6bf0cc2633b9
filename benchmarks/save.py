"""The consolidated HF export on 1, 2 and 4 CPU ranks (FSDP2): time and peak host memory of ``save_pretrained``
against a write floor and against the rank-0 path, interleaved in one run.

    python benchmarks/save.py                     # 1, 2 and 4 ranks, a 1.1 GB fp32 Llama, 3 rounds
    python benchmarks/save.py --ranks 4 --rounds 5

A random Llama (16 layers, hidden 1024, vocabulary 32000: 270M parameters, 1.08 GB in fp32) is saved once. For each
world size one rank group loads it with FSDP2 and then, round after round, runs each contender in turn into a fresh
directory (removed outside the timed span), each round in another order, after a warm-up round:

- ``parallel``: ``model.save_pretrained(dir)``, every rank writing its own shards at their offsets.
- ``rank0``: the same export with rank 0 writing every byte (its fallback where the ranks share no file system:
  each tensor gathered, ``full_tensor()`` on every rank, and written by rank 0): the path before the parallel export.
- ``floor``: each rank writes its local shards' bytes into one file with one ``os.pwritev`` (no header, no index, no
  gathering): the least any export of these bytes can take.

The time is the slowest rank's, between barriers; the memory is each rank's peak RSS growth during the call, beside
the bytes of its local shards.

    python benchmarks/save.py --scenario checkpoint --ranks 2        # training checkpoints: sync against async

Training checkpoints (``automodel.training.checkpoint.Checkpointer``) after every AdamW step of FSDP2 training, the
same model on ``--ranks`` ranks (and ``--small``: the tiny recipe's model), contenders interleaved: ``none``,
``sync`` (``dcp.save`` in the step) and ``async`` (``dcp.async_save``: staged in host memory, written in the
background). The stall is the time the step loop spends in ``save()``; the step time includes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from _ranks import init_rank, run_ranks

MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
)
CONTENDERS = ("parallel", "rank0", "floor")
MODES = ("none", "sync", "async")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256)  # fmt: skip


def make_checkpoint(directory: Path, shape: dict = MODEL) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **shape, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def _rank_main(rank: int, world: int, rendezvous: str, checkpoint: str, scratch: str, rounds: int, results) -> None:
    init_rank(rank, world, rendezvous)
    from unittest import mock

    import torch
    import torch.distributed as dist

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.loading import parallel_export

    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build("fsdp2"))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.state_dict().values()]
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    offsets = [0] * world
    dist.all_gather_object(offsets, local_bytes)

    def floor(directory: Path) -> None:
        path = directory / "floor.bin"
        if rank == 0:
            directory.mkdir()
            with open(path, "wb") as file:
                file.truncate(sum(offsets))
        dist.barrier()
        fd = os.open(path, os.O_WRONLY)
        try:
            buffers = [memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for t in local]
            os.pwritev(fd, buffers, sum(offsets[:rank]))
        finally:
            os.close(fd)

    def rank0(directory: Path) -> None:
        unseen = mock.patch.object(parallel_export, "_has_size", lambda path, size: False)
        if rank != 0:
            with unseen:
                model.save_pretrained(directory)
        else:
            model.save_pretrained(directory)

    run = {"parallel": lambda directory: model.save_pretrained(directory), "rank0": rank0, "floor": floor}
    timings: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    growth: dict[str, list[int]] = {name: [] for name in CONTENDERS}
    for number in range(rounds + 1):  # round 0 warms up (first calls: imports, transformers' conversion tables)
        order = CONTENDERS[number % len(CONTENDERS) :] + CONTENDERS[: number % len(CONTENDERS)]  # none always first
        for name in order:
            directory = Path(scratch) / f"{name}-{number}"
            reset_peak_rss()
            before = rss_bytes()
            dist.barrier()
            start = time.perf_counter()
            run[name](directory)
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if number > 0:
                timings[name].append(elapsed.item())
                growth[name].append(peak_rss_bytes() - before)
            if rank == 0:
                shutil.rmtree(directory)
            dist.barrier()
    results.put((rank, {"timings": timings, "growth": growth, "local_bytes": local_bytes}))
    dist.destroy_process_group()


def _checkpoint_main(rank: int, world: int, rendezvous: str, checkpoint: str, scratch: str, steps: int, results):
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.training.checkpoint import Checkpointer, TrainerState

    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build("fsdp2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, model.config.vocab_size, (2, 128), generator=generator)
    facts: dict[str, dict[str, list[float]]] = {mode: {"step": [], "stall": []} for mode in MODES}
    for number in range(2):  # two passes over the modes, in turn
        for mode in MODES[number % 3 :] + MODES[: number % 3]:
            checkpointer = None
            if mode != "none":
                checkpointer = Checkpointer(Path(scratch) / f"{mode}-{number}", keep=1, asynchronous=mode == "async")
            for step in range(steps):
                dist.barrier()
                start = time.perf_counter()
                model(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                trained = time.perf_counter()
                if checkpointer is not None:
                    state = TrainerState(step + 1, {}, {}, torch.get_rng_state(), [])
                    checkpointer.save(model, optimizer, state)
                done = time.perf_counter()
                if step > 0:  # the first step of a mode warms up (and has no save in flight before it)
                    facts[mode]["step"].append(done - start)
                    facts[mode]["stall"].append(done - trained)
            if checkpointer is not None:
                checkpointer.close()
    results.put((rank, facts))
    dist.destroy_process_group()


def checkpoint_scenario(args: argparse.Namespace) -> None:
    shape = SMALL if args.small else MODEL
    checkpoint = make_checkpoint(args.checkpoint.with_name(args.checkpoint.name + ("-small" if args.small else "")),
                                 shape)  # fmt: skip
    for world in args.ranks:
        with tempfile.TemporaryDirectory(dir=checkpoint.parent) as scratch:
            rows = run_ranks(_checkpoint_main, world, str(checkpoint), scratch, args.steps)
        slowest = {mode: [max(values) for values in zip(*(row[mode]["step"] for row in rows), strict=True)]
                   for mode in MODES}  # fmt: skip
        stall = {mode: [max(values) for values in zip(*(row[mode]["stall"] for row in rows), strict=True)]
                 for mode in MODES}  # fmt: skip
        size = "tiny" if args.small else "270M"
        print(f"| {size}, {world} ranks | " + " | ".join(
            f"{statistics.median(slowest[m]):.3f} s (stall {statistics.median(stall[m]):.3f} s)" for m in MODES
        ) + f" | {statistics.median(stall['async']) / statistics.median(stall['sync']):.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=Path(tempfile.gettempdir()) / "automodel-bench-save")
    parser.add_argument("--scenario", choices=["export", "checkpoint"], default="export")
    parser.add_argument("--steps", type=int, default=4, help="checkpoint scenario: steps per mode and pass")
    parser.add_argument("--small", action="store_true", help="checkpoint scenario: the tiny recipe's model")
    args = parser.parse_args()
    if args.scenario == "checkpoint":
        print("| model | step, no checkpoint | step, sync checkpoint | step, async checkpoint | async stall / sync |")
        print("|---|---|---|---|---|")
        checkpoint_scenario(args)
        return
    checkpoint = make_checkpoint(args.checkpoint)
    size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    print(f"checkpoint: {size / 2**30:.2f} GiB, {args.rounds} rounds, median seconds (slowest rank)")
    print("| ranks | parallel s | rank-0 path s | floor s | parallel / floor | parallel / rank-0 | "
          "peak RSS growth per rank, parallel (rank-0 path) | local shards per rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        with tempfile.TemporaryDirectory(dir=checkpoint.parent) as scratch:
            rows = run_ranks(_rank_main, world, str(checkpoint), scratch, args.rounds)
        median = {name: statistics.median(rows[0]["timings"][name]) for name in CONTENDERS}
        peak = {name: max(max(row["growth"][name]) for row in rows) for name in CONTENDERS}
        shards = max(row["local_bytes"] for row in rows)
        print(
            f"| {world} | {median['parallel']:.2f} | {median['rank0']:.2f} | {median['floor']:.2f} | "
            f"{median['parallel'] / median['floor']:.2f}x | {median['parallel'] / median['rank0']:.2f}x | "
            f"{peak['parallel'] / 2**20:.0f} MiB ({peak['rank0'] / 2**20:.0f} MiB) | {shards / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
