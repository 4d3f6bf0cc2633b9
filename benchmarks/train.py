"""SFT step throughput on N CPU ranks: this project's training step vs a plain AdamW loop over transformers' own
FSDP2 model vs a floor, in one run.

    python benchmarks/train.py --nproc 2

A random Llama (about 40 M parameters) is saved once. Every contender starts N fresh gloo ranks, loads it, and runs
``--warmup`` + ``--steps`` optimizer steps on the same random token batches: ``--global-batch`` sequences of
``--seq`` tokens per step, ``--micro-batch`` per forward (gradient accumulation), gradient clipping at 1.0, AdamW.
Reported: global tokens/s of the median step and the ratio to the floor.

Contenders:

- ``floor``: each rank trains a plain unsharded copy on its own micro batches, no communication (perfect data
  parallelism for this model and batch);
- ``automodel``: ``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))`` trained
  with ``automodel.training`` (``train_step``: token-weighted loss over the global batch, gradient sync on the last
  micro batch only; ``clip_grad_norm``; AdamW);
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

from _ranks import init_rank, run_ranks

CONTENDERS = ("floor", "automodel", "transformers")


def make_checkpoint(directory: Path) -> Path:
    """A random fp32 Llama (about 40 M parameters), saved once."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


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


def _rank_main(rank: int, world: int, port: int, contender: str, directory: str, args: dict, results) -> None:
    init_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    if contender == "automodel":
        from automodel import MeshContext, NeMoAutoModelForCausalLM
        from automodel.training.loop import train_step
        from automodel.training.optim import clip_grad_norm

        context = MeshContext.build("fsdp2")
        model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context)

        def step_fn(micro_batches):
            train_step(model, micro_batches, context)
            clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        kwargs = {}
        if contender == "transformers":
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(fsdp_size=world)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)

        def step_fn(micro_batches):
            _step_floor_or_transformers(model, optimizer, micro_batches)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    times = []
    for step in range(args["warmup"] + args["steps"]):
        micro_batches = _batches(args, rank, world, model.config.vocab_size, step)
        dist.barrier()
        start = time.perf_counter()
        step_fn(micro_batches)
        dist.barrier()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - start)
    results.put((rank, statistics.median(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "automodel-train-bench")
    options = parser.parse_args()
    directory = make_checkpoint(options.dir)
    args = {"global_batch": options.global_batch, "micro_batch": options.micro_batch, "seq": options.seq}
    args.update(warmup=options.warmup, steps=options.steps)
    tokens = options.global_batch * options.seq
    rows = {}
    for contender in options.contenders.split(","):
        seconds = max(run_ranks(_rank_main, options.nproc, contender, str(directory), args))
        rows[contender] = seconds
        print(f"{contender}: {seconds:.3f} s/step, {tokens / seconds:.0f} tokens/s", flush=True)
    floor = rows.get("floor")
    print(
        f"\n{options.nproc} CPU ranks, {options.global_batch}x{options.seq} tokens per step, micro batch {options.micro_batch}"
    )
    print(f"{'contender':<14} {'step s':>8} {'tokens/s':>10} {'vs floor':>9}")
    for contender, seconds in rows.items():
        ratio = f"{floor / seconds:9.2f}" if floor else "        -"
        print(f"{contender:<14} {seconds:8.3f} {tokens / seconds:10.0f} {ratio}")


if __name__ == "__main__":
    main()
