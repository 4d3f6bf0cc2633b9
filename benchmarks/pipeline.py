"""Pipeline parallelism on N CPU ranks: the measured bubble of each schedule against its ideal, and the step's
throughput against FSDP2 on the same ranks, in one run.

    python benchmarks/pipeline.py --nproc 2            # PP2: gpipe, 1f1b; interleaved_1f1b, interleaved_zero_bubble
                                                       # and zbv with 2 stages per rank
    python benchmarks/pipeline.py --nproc 4            # PP4

A random Llama (8 layers, hidden 256, vocabulary 4096) is saved once. Each contender starts N fresh gloo ranks,
loads it with ``NeMoAutoModelForCausalLM.from_pretrained`` and runs ``--warmup`` + ``--steps`` AdamW steps on the
same random token batches (``--microbatches`` rows of ``--seq`` tokens per step).

- ``pp:<schedule>``: ``MeshContext.build("fsdp2", pp_size=N, pp_schedule=..., pp_microbatches=M)`` and
  ``model.train_step``; the bubble is the model's own measurement (``PipelinedModel.last_bubble``: the share of the
  step each rank spends outside its stages' forward and backward, averaged over the pipeline ranks), the median of
  the measured steps. The floor is the ideal ``(P - 1) / (V M + P - 1)``.
- ``fsdp2``: the peer, the same model and batch under FSDP2 over the N ranks (each rank ``M / N`` rows), with the
  recipes' ``train_step``.

On a machine with fewer cores than ranks, ranks computing at once share cores: a step's compute time grows with the
number of ranks busy together, which the bubble measures as busy time, not idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _ranks import init_rank, run_ranks

MODEL = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
MULTI_STAGE = {"interleaved_1f1b", "interleaved_zero_bubble", "zbv"}  # run with 2 stages per rank


def make_checkpoint(directory: Path) -> Path:
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **MODEL, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def _rank_main(rank: int, world: int, rendezvous: str, contender: str, directory: str, args: dict, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.training.loop import train_step

    if contender == "fsdp2":
        context = MeshContext.build("fsdp2")
    else:
        schedule = contender.removeprefix("pp:")
        virtual = 2 if schedule in MULTI_STAGE else 1
        context = MeshContext.build(
            "fsdp2",
            pp_size=world,
            pp_schedule=schedule,
            pp_microbatches=args["microbatches"],
            pp_virtual_stages=virtual,
        )
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    times, bubbles = [], []
    for step in range(args["warmup"] + args["steps"]):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, MODEL["vocab_size"], (args["microbatches"], args["seq"]), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        if contender == "fsdp2":
            mine = tokens.chunk(world)[rank]
            train_step(model, [{"input_ids": mine, "labels": mine}], context)
        else:
            model.train_step(input_ids=tokens, labels=tokens)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - start)
            bubbles.append(getattr(model, "last_bubble", None))
    bubble = statistics.median(bubbles) if bubbles[0] is not None else None
    results.put((rank, (statistics.median(times), bubble)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8, help="rows per step, one per microbatch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--contenders", default=",".join([*(f"pp:{name}" for name in SCHEDULES), "fsdp2"]))
    parser.add_argument("--dir", type=Path, help="where the random checkpoint is saved (once)")
    options = parser.parse_args()
    args = {key: getattr(options, key) for key in ("microbatches", "seq", "warmup", "steps")}
    directory = make_checkpoint(options.dir or Path(os.environ.get("TMPDIR", "/tmp")) / "automodel-bench-pipeline")
    from automodel.distributed.pipeline_layout import ideal_bubble

    tokens = options.microbatches * options.seq
    print(f"{options.nproc} ranks, {options.microbatches} microbatches of {options.seq} tokens per step")
    print(f"{'contender':<22} {'step s':>8} {'tokens/s':>9} {'bubble':>8} {'ideal':>8}")
    for contender in options.contenders.split(","):
        rows = run_ranks(_rank_main, options.nproc, contender, str(directory), args)
        seconds = max(row[0] for row in rows)
        bubble = rows[0][1]
        ideal = "-"
        if contender.startswith("pp:"):
            schedule = contender.removeprefix("pp:")
            virtual = 2 if schedule in MULTI_STAGE else 1
            ideal = f"{ideal_bubble(schedule, options.nproc, options.microbatches, virtual):.1%}"
        shown = "-" if bubble is None else f"{bubble:.1%}"
        print(f"{contender:<22} {seconds:8.3f} {tokens / seconds:9.0f} {shown:>8} {ideal:>8}")


if __name__ == "__main__":
    main()
