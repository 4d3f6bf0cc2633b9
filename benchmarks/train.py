"""SFT step throughput and peak step memory on N CPU ranks: this project's training step (plain, with compiled
blocks, with the fused loss) vs a plain AdamW loop over transformers' own FSDP2 model vs a floor, in one run.

    python benchmarks/train.py --nproc 2                      # throughput, with and without layout.compile
    python benchmarks/train.py --nproc 2 --scenario memory    # peak step memory, with and without the fused loss

A random Llama (32 M parameters; the large one 302 M) is saved once. Every contender starts N fresh gloo ranks, loads it, and runs
``--warmup`` + ``--steps`` optimizer steps on the same random token batches: ``--global-batch`` sequences of
``--seq`` tokens per step, ``--micro-batch`` per forward (gradient accumulation), gradient clipping at 1.0, AdamW.
Reported: global tokens/s of the median step and the ratio to the floor, the step's CPU seconds (user + system, the
work the rank itself did: on cores shared with other work wall time also measures the neighbours), and each rank's
peak resident-memory growth during a step (the kernel's peak counter reset right before the step, minus the resident memory then; the
worst step of the worst rank).

Scenarios:

- ``throughput`` (default): the 32 M Llama (vocabulary 8192), 8 x 256 tokens per step in micro batches of 2;
- ``large``: a ~300 M Llama (hidden 1024, 20 layers, vocabulary 32000), 8 x 128 tokens per step in micro batches
  of 1 (run it with ``--nproc 4``);
- ``memory``: a tiny Llama with Llama 3's 128k vocabulary (hidden 128, 2 layers), one sequence of 2048 tokens per
  rank per step, where the logits (2048 x 128256 fp32 = 1 GB per sequence, and as much again for their gradient)
  dominate the step's memory.

Contenders:

- ``floor``: each rank trains a plain unsharded copy on its own micro batches, no communication (perfect data
  parallelism for this model and batch);
- ``automodel``: ``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))`` trained
  with ``automodel.training`` (``train_step``: token-weighted loss over the global batch, gradient sync on the last
  micro batch only; ``clip_grad_norm``; AdamW);
- ``automodel+compile``: the same with ``MeshContext.build("fsdp2", compile=True)`` (each decoder block
  ``torch.compile``d; inductor compiles during the warm-up steps);
- ``automodel+fused``: the same with ``train.loss: fused`` (``FusedLinearCrossEntropy``, 1024-token chunks by
  default: ``--chunk``);
- ``automodel+always`` / ``+never`` / ``+noprefetch`` / ``+microsync``: the reshard policy ZeRO-3 / ZeRO-2, without
  the explicit layer prefetch, the gradients reduced after every micro batch (``train.grad_sync: micro_batch``)
  instead of once per step;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=N))``
  with the plain loop (``loss / accumulation``, backward per micro batch, ``torch.nn.utils.clip_grad_norm_``, AdamW).
  transformers' ``Trainer`` is no peer here: its FSDP2 falls back to DDP on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from _ranks import init_rank, run_ranks

AUTOMODEL_OPTIONS = ("compile", "fused", "always", "never", "noprefetch", "microsync")

# Per scenario: the model, the batch and the contenders compared in one run.
SCENARIOS = {
    "throughput": {
        "model": dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8192,
            max_position_embeddings=1024,
        ),
        "batch": dict(global_batch=8, micro_batch=2, seq=256, warmup=2, steps=5),
        "contenders": "floor,automodel,automodel+compile,transformers",
    },
    "large": {
        "model": dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=1024,
        ),
        "batch": dict(global_batch=8, micro_batch=1, seq=128, warmup=1, steps=3),
        "contenders": "automodel,transformers",
    },
    "memory": {
        "model": dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128256,
            max_position_embeddings=2048,
        ),
        "batch": dict(global_batch=None, micro_batch=1, seq=2048, warmup=1, steps=2),
        "contenders": "automodel,automodel+fused",
    },
}


def make_checkpoint(directory: Path, shape: dict) -> Path:
    """A random fp32 Llama of ``shape``, saved once per directory."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **shape, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def parse_contender(name: str) -> tuple[str, set[str]]:
    """``"automodel+compile+fused"`` -> ``("automodel", {"compile", "fused"})``; options only for automodel."""
    base, *options = name.split("+")
    unknown = set(options) - set(AUTOMODEL_OPTIONS) if base == "automodel" else set(options)
    if base not in ("floor", "automodel", "transformers") or unknown:
        raise SystemExit(
            f"unknown contender {name!r}: floor, transformers, or automodel[+compile][+fused][+always|+never][+noprefetch][+microsync]"
        )
    return base, set(options)


def _batches(args: dict, rank: int, dp_size: int, vocab: int, step: int):
    """This rank's micro batches of global step ``step`` (the same tokens for every contender)."""
    import torch

    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (args["global_batch"], args["seq"]), generator=generator)
    mine = tokens.chunk(dp_size)[rank]
    return [{"input_ids": chunk, "labels": chunk} for chunk in mine.split(args["micro_batch"])]


def _step_floor_or_transformers(model, optimizer, micro_batches):
    import torch

    for batch in micro_batches:
        (model(**batch).loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank_main(rank: int, world: int, rendezvous: str, contender: str, directory: str, args: dict, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    base, options = parse_contender(contender)
    if base == "automodel":
        from automodel import MeshContext, NeMoAutoModelForCausalLM
        from automodel.distributed import FSDP2Config
        from automodel.training.loop import train_step
        from automodel.training.loss import make_loss
        from automodel.training.optim import clip_grad_norm

        policy = True if "always" in options else False if "never" in options else None
        strategy = FSDP2Config(reshard_after_forward=policy, prefetch="noprefetch" not in options)
        context = MeshContext.build(strategy, compile="compile" in options)
        model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context)
        loss_fn = make_loss("fused" if "fused" in options else "model", args["chunk"])
        grad_sync = "micro_batch" if "microsync" in options else "step"

        def step_fn(micro_batches):
            train_step(model, micro_batches, context, loss_fn, grad_sync=grad_sync)
            clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        kwargs = {}
        if base == "transformers":
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(fsdp_size=world)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)

        def step_fn(micro_batches):
            _step_floor_or_transformers(model, optimizer, micro_batches)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    times, cpus, peaks = [], [], []
    for step in range(args["warmup"] + args["steps"]):
        micro_batches = _batches(args, rank, world, model.config.vocab_size, step)
        dist.barrier()
        reset_peak_rss()
        before = rss_bytes()
        start, cpu_start = time.perf_counter(), time.process_time()
        step_fn(micro_batches)
        cpu = time.process_time() - cpu_start
        dist.barrier()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - start)
            cpus.append(cpu)
            peaks.append(peak_rss_bytes() - before)
    profile = None
    if args.get("profile"):
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        micro_batches = _batches(args, rank, world, model.config.vocab_size, 0)
        dist.barrier()
        with profiler(activities=[ProfilerActivity.CPU]) as recorded:
            step_fn(micro_batches)
            dist.barrier()
        profile = {event.key: (event.self_cpu_time_total, event.count) for event in recorded.key_averages()}
    results.put((rank, (statistics.median(times), statistics.median(cpus), max(peaks), profile)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="throughput")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: 8; memory: one per rank)")
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the fused loss")
    parser.add_argument(
        "--contenders",
        help="comma-separated: floor, transformers, automodel[+compile][+fused][+always|+never][+noprefetch][+microsync]",
    )
    parser.add_argument("--dir", type=Path, help="where the random checkpoint is saved (once)")
    parser.add_argument("--rounds", type=int, default=1, help="run the contenders this many times, interleaved")
    parser.add_argument("--profile", action="store_true", help="also profile one step of each contender (rank 0)")
    options = parser.parse_args()
    scenario = SCENARIOS[options.scenario]
    args = dict(scenario["batch"], chunk=options.chunk)
    for key in ("global_batch", "micro_batch", "seq", "warmup", "steps"):
        if getattr(options, key) is not None:
            args[key] = getattr(options, key)
    args["global_batch"] = args["global_batch"] or options.nproc * args["micro_batch"]
    contenders = (options.contenders or scenario["contenders"]).split(",")
    for contender in contenders:
        parse_contender(contender)
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    directory = make_checkpoint(options.dir or tmp / f"automodel-train-bench-{options.scenario}", scenario["model"])
    tokens = args["global_batch"] * args["seq"]
    args["profile"] = options.profile
    measured: dict[str, list[tuple[float, float, float]]] = {contender: [] for contender in contenders}
    profiles: dict[str, dict] = {}
    for round_number in range(options.rounds):  # interleaved: each round runs every contender once
        for contender in contenders:
            per_rank = run_ranks(_rank_main, options.nproc, contender, str(directory), args)
            seconds, cpu, peak = (max(values) for values in zip(*[row[:3] for row in per_rank], strict=True))
            measured[contender].append((seconds, cpu, peak))
            if per_rank[0][3] is not None:
                profiles[contender] = per_rank[0][3]
            print(
                f"round {round_number + 1} {contender}: {seconds:.3f} s/step ({cpu:.3f} CPU s), "
                f"{tokens / seconds:.0f} tokens/s, peak step growth {peak / 2**20:.0f} MiB",
                flush=True,
            )
    rows = {
        contender: {
            "seconds": statistics.median(seconds for seconds, _, _ in runs),
            "cpu": statistics.median(cpu for _, cpu, _ in runs),
            "peak": max(peak for _, _, peak in runs),
        }
        for contender, runs in measured.items()
    }
    print(
        f"\n{options.scenario}: {options.nproc} CPU ranks, {args['global_batch']}x{args['seq']} tokens per step, "
        f"micro batch {args['micro_batch']}, vocabulary {scenario['model']['vocab_size']}; worst rank, median step"
    )
    reference = "floor" if "floor" in rows else contenders[0]
    ref = rows[reference]
    header = f"x {reference}"
    print(
        f"{'contender':<26} {'step s':>8} {'tokens/s':>10} {header:>12} {'CPU s':>8} {header:>12} {'peak MiB':>9} "
        f"{header:>12}"
    )
    for contender, row in rows.items():
        print(
            f"{contender:<26} {row['seconds']:8.3f} {tokens / row['seconds']:10.0f} {ref['seconds'] / row['seconds']:12.2f} "
            f"{row['cpu']:8.3f} {ref['cpu'] / row['cpu']:12.2f} {row['peak'] / 2**20:9.0f} {row['peak'] / ref['peak']:12.2f}"
        )
    for contender in rows:
        if contender.startswith("automodel") and "transformers" in rows:
            print(
                f"{contender} vs transformers: tokens/s x {rows['transformers']['seconds'] / rows[contender]['seconds']:.2f}"
                f", peak step memory x {rows[contender]['peak'] / rows['transformers']['peak']:.2f}"
            )
    if profiles:
        _print_profile_differences(profiles)
    for option in AUTOMODEL_OPTIONS:
        if "automodel" in rows and f"automodel+{option}" in rows:
            plain, other = rows["automodel"], rows[f"automodel+{option}"]
            print(
                f"automodel+{option} vs automodel: tokens/s x {plain['seconds'] / other['seconds']:.2f} (per CPU second "
                f"x {plain['cpu'] / other['cpu']:.2f}), peak step memory x {other['peak'] / plain['peak']:.2f}"
            )


def _print_profile_differences(profiles: dict[str, dict], top: int = 15) -> None:
    """Rank 0's profiled step per contender: self CPU milliseconds by operator and record label, the largest
    differences against the first contender."""
    names = list(profiles)
    first = profiles[names[0]]
    keys = set().union(*(profile.keys() for profile in profiles.values()))

    def ms(profile: dict, key: str) -> float:
        return profile.get(key, (0, 0))[0] / 1000

    spread = sorted(keys, key=lambda key: -max(abs(ms(p, key) - ms(first, key)) for p in profiles.values()))
    print(f"\nprofiled step, rank 0, self CPU ms (calls); largest differences against {names[0]}:")
    print(f"| operator or label | {' | '.join(names)} |")
    print(f"| --- |{' ---: |' * len(names)}")
    for key in spread[:top]:
        cells = [f"{ms(p, key):.1f} ({p.get(key, (0, 0))[1]})" for p in profiles.values()]
        print(f"| `{key}` | {' | '.join(cells)} |")
    for label, prefix in (
        ("all FSDP all-gathers", "FSDP::all_gather ("),
        ("all FSDP reductions", "FSDP::post_backward_reduce"),
    ):
        cells = []
        for profile in profiles.values():
            matched = [value for key, value in profile.items() if key.startswith(prefix)]
            cells.append(f"{sum(v[0] for v in matched) / 1000:.1f} ({sum(v[1] for v in matched)})")
        print(f"| {label} | {' | '.join(cells)} |")
    totals = [sum(value[0] for value in p.values()) / 1000 for p in profiles.values()]
    print(f"| all | {' | '.join(f'{total:.1f}' for total in totals)} |")


if __name__ == "__main__":
    main()
