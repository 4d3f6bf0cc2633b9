"""The GPU figures of issue 18, in one short run: a ~1.2 B-parameter Llama (Llama 3.2 1B's shape, random weights),
bf16, on the GPUs torchrun starts (one is enough).

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --out gpu_check.json
    python benchmarks/gpu_check.py --tiny          # CPU smoke test of every code path (gloo, a tiny model)

Measured, each a median over a few repeats / steps, ratios taken in the same run:

- **load**: the file-to-GPU floor (every safetensors file read with ``safetensors.torch.load_file(device="cuda")``;
  each rank reads the whole checkpoint, the least a loader must move to the device), ``automodel``
  (``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))``), transformers
  ``from_pretrained(device_map="cuda")`` and transformers ``DistributedConfig(fsdp_size=N)``; page cache warm.
- **training**: tokens/s, MFU (``--peak-tflops`` per GPU; 989 for H100/H200 dense bf16) and peak GPU memory of
  automodel (``train_step`` + ``clip_grad_norm`` + fused AdamW) plain, with ``compile=True``, with the chunked loss,
  and with both, against transformers ``DistributedConfig(fsdp_size=N)`` + a plain loop (``loss / accumulation``,
  ``clip_grad_norm_``, fused AdamW). Same random batches for every contender; compile happens in the warm-up steps.

Each part records its error and the others still run; rank 0 prints one JSON line per part and writes ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

# Llama 3.2 1B: 1.24 B parameters (tied embeddings), 128k vocabulary.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
TRAIN_CONTENDERS = ("automodel", "automodel+compile", "automodel+chunked", "automodel+compile+chunked", "transformers")


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def make_checkpoint(directory: Path, shape: dict) -> Path:
    """A random bf16 Llama of ``shape``, written by rank 0 in 2 GB shards (skipped when present)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.get_rank() == 0 and not (directory / "config.json").is_file():
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **shape)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory, max_shard_size="2GB")
    dist.barrier()
    return directory


def _warm(directory: Path) -> None:
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as stream:
            while stream.read(64 << 20):
                pass


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    _sync()
    start = time.perf_counter()
    result = fn()
    _sync()
    seconds = time.perf_counter() - start
    dist.barrier()
    return result, seconds


def load_times(directory: Path, repeats: int) -> dict:
    """Median load seconds of each contender (worst rank), and each one's ratio to the file-to-GPU floor."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    device = _device()
    files = sorted(directory.glob("*.safetensors"))
    context = MeshContext.build("fsdp2")
    contenders = {
        "floor_file_to_gpu": lambda: [load_file(path, device=str(device)) for path in files],
        "automodel": lambda: NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, dtype="auto"),
        "transformers_device_map": lambda: AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, device_map=str(device)
        ),
        "transformers_distributed_config": lambda: AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size())
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    errors = {}
    for _ in range(repeats):
        for name, load in contenders.items():
            if name in errors:
                continue
            _warm(directory)
            try:
                loaded, took = _timed(load)
            except Exception as error:  # a contender that cannot run here is a result
                errors[name] = f"{type(error).__name__}: {error}"[:500]
                continue
            worst = torch.tensor(took, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            seconds[name].append(worst.item())
            del loaded
            _free()
    medians = {name: statistics.median(values) for name, values in seconds.items() if values}
    floor = medians.get("floor_file_to_gpu")
    return {
        "checkpoint_gb": round(sum(path.stat().st_size for path in files) / 1e9, 3),
        "seconds": {name: round(value, 3) for name, value in medians.items()},
        "x_floor": {name: round(value / floor, 2) for name, value in medians.items()} if floor else None,
        "errors": errors,
    }


def _batches(step: int, args: argparse.Namespace, vocab: int, rank: int, world: int):
    import torch

    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (args.global_batch, args.seq), generator=generator)
    mine = tokens.chunk(world)[rank]
    return [{"input_ids": chunk, "labels": chunk} for chunk in mine.split(args.micro_batch)]


def _automodel_step(directory: Path, options: set[str], chunk: int):
    import torch

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.training.loop import train_step
    from automodel.training.loss import make_loss
    from automodel.training.optim import clip_grad_norm

    context = MeshContext.build("fsdp2", compile="compile" in options)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, dtype="auto").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    loss_fn = make_loss("chunked" if "chunked" in options else "model", chunk)

    def step(micro_batches):
        train_step(model, micro_batches, context, loss_fn)
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def _transformers_step(directory: Path):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, distributed_config=DistributedConfig(fsdp_size=dist.get_world_size())
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    device = _device()

    def step(micro_batches):
        for batch in micro_batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            (model(**batch, use_cache=False).loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def training(directory: Path, contender: str, args: argparse.Namespace) -> dict:
    """Median step time, tokens/s, MFU and peak GPU memory of one contender."""
    import torch
    import torch.distributed as dist

    from automodel.loading.pipeline import transformers_model
    from automodel.training.metrics import flops_per_token, model_flops_utilization

    base, *options = contender.split("+")
    if base == "automodel":
        model, step_fn = _automodel_step(directory, set(options), args.chunk)
    else:
        model, step_fn = _transformers_step(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = model.config.vocab_size
    times = []
    for index in range(args.warmup + args.steps):
        micro_batches = _batches(index, args, vocab, rank, world)
        _, took = _timed(lambda batches=micro_batches: step_fn(batches))
        if index >= args.warmup:
            times.append(took)
    seconds = statistics.median(times)
    tokens_per_s = args.global_batch * args.seq / seconds
    flops = flops_per_token(transformers_model(model), args.seq)
    mfu = model_flops_utilization(tokens_per_s, flops, args.peak_tflops if torch.cuda.is_available() else None, world)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    del model
    _free()
    return {
        "step_s": round(seconds, 4),
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(mfu, 4) if mfu is not None else None,
        "peak_gpu_gib": round(peak, 2) if peak is not None else None,
    }


def _start(tiny: bool) -> None:
    """A process group from torchrun's environment (NCCL on GPUs), or a one-rank gloo group for ``--tiny``."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        if not tiny:
            raise SystemExit("launch with torchrun (torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py)")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available() and not tiny:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model, 1 gloo rank, few steps")
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="write every result as JSON (rank 0)")
    parser.add_argument("--parts", default="load,train", help="comma-separated: load, train")
    parser.add_argument("--contenders", default=",".join(TRAIN_CONTENDERS))
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (all ranks)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compile happens here)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (MFU)")
    args = parser.parse_args(argv)
    unknown = set(args.contenders.split(",")) - set(TRAIN_CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}: choose from {', '.join(TRAIN_CONTENDERS)}")
    if args.tiny:
        args.seq, args.global_batch, args.micro_batch, args.warmup, args.steps = 64, 2, 1, 1, 1
        args.load_repeats, args.chunk = 1, 16
    return args


def main() -> None:
    args = parse_args()
    _start(args.tiny)
    import torch
    import torch.distributed as dist

    results: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    results["world_size"] = dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        holder = [str(args.dir or Path(tmp) / "llama")]
        dist.broadcast_object_list(holder)
        directory = make_checkpoint(Path(holder[0]), TINY if args.tiny else LLAMA_1B)
        parts = {"load": lambda: load_times(directory, args.load_repeats)}
        for contender in args.contenders.split(","):
            parts[f"train:{contender}"] = lambda contender=contender: training(directory, contender, args)
        for name, part in parts.items():
            if name.split(":")[0] not in args.parts.split(","):
                continue
            try:
                results[name] = part()
            except Exception as error:  # a failing part is a result; the others still run
                results[name] = {
                    "error": f"{type(error).__name__}: {error}"[:1000],
                    "trace": traceback.format_exc()[-3000:],
                }
                _free()
            if dist.get_rank() == 0:
                print(json.dumps({name: results[name]}), flush=True)
    train = {
        name.split(":")[1]: row for name, row in results.items() if name.startswith("train:") and "error" not in row
    }
    if "automodel" in train and "transformers" in train:
        plain = train["automodel"]["tokens_per_s"]
        results["tokens_per_s_vs_transformers"] = {
            name: round(row["tokens_per_s"] / train["transformers"]["tokens_per_s"], 3) for name, row in train.items()
        }
        results["tokens_per_s_vs_automodel"] = {
            name: round(row["tokens_per_s"] / plain, 3) for name, row in train.items()
        }
    if dist.get_rank() == 0:
        print(
            json.dumps({key: results.get(key) for key in ("tokens_per_s_vs_transformers", "tokens_per_s_vs_automodel")})
        )
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
