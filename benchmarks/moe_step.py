"""MoE training-step throughput on N CPU ranks: expert parallelism EP=1/2/4 vs transformers' own EP vs a floor.

    python benchmarks/moe_step.py --nproc 4

A random Mixtral (8 experts, top-2) is saved once; every contender starts N fresh gloo ranks, loads it, and runs
``--warmup`` + ``--steps`` training steps (forward, backward, AdamW) on its own batch of ``--batch`` x ``--seq``
tokens per data-parallel rank. Reported: global tokens/s (median step), and the ratio to the floor of the same run.

Contenders:

- ``floor``: every rank trains a plain unsharded copy on its own batch, no communication at all (perfect data
  parallelism: the most N ranks can do with this model and batch);
- ``automodel-ep{E}``: ``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2",
  ep_size=E))`` (EP=1: FSDP2 shards the experts like dense weights);
- ``transformers-ep{E}``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(
  fsdp_size=N, ep_size=E))`` (transformers' own FSDP2 + EP), E > 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _ranks import init_rank, run_ranks


def make_checkpoint(directory: Path) -> Path:
    """A random fp32 Mixtral (about 60 M parameters), saved once."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=4096,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def _build(contender: str, directory: Path, world: int):
    """The model for ``contender`` and the number of ranks that see different batches."""
    import torch
    from transformers import AutoModelForCausalLM

    if contender == "floor":
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), world
    ep = int(contender.rpartition("ep")[2])
    if contender.startswith("automodel"):
        from automodel import MeshContext, NeMoAutoModelForCausalLM

        context = MeshContext.build("fsdp2", ep_size=ep)
        return NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context), context.dp_size
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(fsdp_size=world, ep_size=ep)
    return AutoModelForCausalLM.from_pretrained(directory, distributed_config=config, dtype=torch.float32), world


def _rank_main(rank: int, world: int, rendezvous: str, contender: str, directory: str, args: dict, results) -> None:
    init_rank(rank, world, rendezvous)
    import torch
    import torch.distributed as dist

    model, batches = _build(contender, Path(directory), world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    generator = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(args["warmup"] + args["steps"]):
        batch = torch.randint(0, vocab, (args["batch"], args["seq"]), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - start)
    results.put((rank, (statistics.median(times), batches * args["batch"] * args["seq"], float(loss.detach()))))
    dist.destroy_process_group()


def run_contender(contender: str, directory: Path, world: int, args: dict) -> dict:
    """Start ``world`` fresh ranks for ``contender``; return its median step time and global tokens/s."""
    rows = run_ranks(_rank_main, world, contender, str(directory), args)
    seconds = max(row[0] for row in rows)
    return {"seconds": seconds, "tokens_per_s": rows[0][1] / seconds, "loss": rows[0][2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ep", default="1,2,4", help="EP sizes for this project (1 = experts sharded by FSDP2)")
    parser.add_argument("--peer-ep", default="2,4", help="EP sizes for transformers' own DistributedConfig")
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "automodel-moe-bench")
    options = parser.parse_args()
    directory = make_checkpoint(options.dir)
    args = {key: getattr(options, key) for key in ("batch", "seq", "warmup", "steps")}
    contenders = ["floor", *(f"automodel-ep{e}" for e in options.ep.split(","))]
    contenders += [f"transformers-ep{e}" for e in options.peer_ep.split(",") if e]
    rows = {}
    for contender in contenders:
        rows[contender] = run_contender(contender, directory, options.nproc, args)
        print(f"{contender}: {rows[contender]}", flush=True)
    floor = rows["floor"]["tokens_per_s"]
    print(f"\n{options.nproc} CPU ranks, {args['batch']}x{args['seq']} tokens per data-parallel rank")
    print(f"{'contender':<20} {'step s':>8} {'tokens/s':>10} {'vs floor':>9}")
    for contender, row in rows.items():
        print(f"{contender:<20} {row['seconds']:8.3f} {row['tokens_per_s']:10.0f} {row['tokens_per_s'] / floor:9.2f}")


if __name__ == "__main__":
    main()
