"""The GPU figures of issue 43 in one run: a Llama of Llama 3.2 1B's shape (1.24 B parameters, tied embeddings) or, with
``--shape 8b``, Llama 3 8B's (random weights), bf16, on the GPUs torchrun starts (one is enough).

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --out gpu_check.json [--shape 8b]
    python benchmarks/gpu_check.py --tiny          # CPU smoke test of every code path (gloo, a tiny model)

Measured, each a median over a few repeats / steps, ratios taken in the same run:

- **load** (page cache warm): the floors (every safetensors file read by parallel readers into pinned memory, and the
  host-to-device copy of those bytes; and ``safetensors.torch.load_file(device="cuda")`` of each file),
  ``automodel`` (``NeMoAutoModelForCausalLM.from_pretrained(dir, mesh_context=MeshContext.build("fsdp2"))``) and
  transformers ``from_pretrained(device_map="cuda")`` (with ``DistributedConfig(fsdp_size=N)`` too on N > 1 GPUs).
- **training**: tokens/s, MFU (``--peak-tflops`` per GPU; 989 for H100/H200 dense bf16) and peak GPU memory of
  ``automodel`` with the library's defaults (``train_step`` + ``clip_grad_norm`` + fused AdamW; compile ``"auto"``,
  the recipes' default loss), and variants: ``+eager`` (``compile=False``), ``+fused`` / ``+model`` (that loss),
  against ``transformers``: the model on the GPU (``device_map`` on one GPU, ``DistributedConfig(fsdp_size=N)`` on
  N) and a plain loop (``loss / accumulation``, ``clip_grad_norm_``, fused AdamW). Same random batches for every
  contender; compilation happens in the warm-up steps.

Each part records its error and the others still run; rank 0 prints one JSON line per part and rewrites ``--out``
after each, so a run stopped at its time limit keeps what it measured.
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
# Llama 3 8B: 8.03 B parameters, untied head.
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
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
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
# automodel with the library's defaults, then the variants: +eager (compile=False), +fused / +model (that loss),
# +chunkN (the fused loss over chunks of N tokens).
TRAIN_OPTIONS = ("eager", "fused", "model")
DEFAULT_CONTENDERS = "automodel,automodel+eager,automodel+model,transformers"


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
    """A random bf16 Llama of ``shape``, initialised on the device and written by rank 0 in 2 GB shards (skipped when
    present)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.get_rank() == 0 and not (directory / "config.json").is_file():
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **shape)
        with torch.device(_device()):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(directory, max_shard_size="2GB")
        del model
        _free()
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


def _transformers_placement() -> dict:
    """transformers' way onto the GPUs: ``device_map`` on one, ``DistributedConfig(fsdp_size=N)`` on N (which keeps
    a one-rank model on the CPU, so one GPU gets the ``device_map``)."""
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    if world == 1:
        return {"device_map": str(_device())}
    return {"distributed_config": DistributedConfig(fsdp_size=world)}


def _load_floors(files: list[Path]) -> dict[str, float]:
    """The two floors of a loader, from automodel's own readers: the parallel read of every file into pinned
    memory, and the host-to-device copy of those bytes (seconds each)."""
    from automodel.loading.reader import floor_seconds

    return {name: value for name, value in floor_seconds(files, _device()).items() if name.endswith("_s")}


def load_times(directory: Path, repeats: int) -> dict:
    """Median load seconds of each contender (worst rank), and each one's ratio to the file-to-GPU floor."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    device = _device()
    files = sorted(directory.glob("*.safetensors"))
    context = MeshContext.build("fsdp2")
    contenders = {
        "floor_load_file_to_gpu": lambda: [load_file(path, device=str(device)) for path in files],
        "automodel": lambda: NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, dtype="auto"),
        "transformers": lambda: AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, **_transformers_placement()
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in [*contenders, "floor_read_pinned", "floor_h2d"]}
    errors = {}
    for _ in range(repeats):
        _warm(directory)
        try:
            for name, value in _load_floors(files).items():
                seconds[f"floor_{name.removesuffix('_s')}"].append(value)
        except Exception as error:  # the floors are a result like the others
            errors["floors"] = f"{type(error).__name__}: {error}"[:500]
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
    gb = sum(path.stat().st_size for path in files) / 1e9
    result = {
        "checkpoint_gb": round(gb, 3),
        "seconds": {name: round(value, 3) for name, value in medians.items()},
        "gb_per_s": {name: round(gb / value, 2) for name, value in medians.items() if value},
        "errors": errors,
    }
    if "automodel" in medians and "transformers" in medians:
        result["automodel_vs_transformers_speed"] = round(medians["transformers"] / medians["automodel"], 3)
    return result


def _batches(step: int, args: argparse.Namespace, vocab: int, rank: int, world: int):
    import torch

    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (args.global_batch, args.seq), generator=generator)
    mine = tokens.chunk(world)[rank]
    return [{"input_ids": chunk, "labels": chunk} for chunk in mine.split(args.micro_batch)]


def _automodel_step(directory: Path, options: set[str], chunk: int | None):
    """The library's defaults (compile ``"auto"``, the recipes' default loss), or the variant ``options`` name."""
    import torch

    from automodel import MeshContext, NeMoAutoModelForCausalLM
    from automodel.training.loop import train_step
    from automodel.training.loss import choose_loss
    from automodel.training.optim import clip_grad_norm

    context = MeshContext.build("fsdp2", **({"compile": False} if "eager" in options else {}))
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, mesh_context=context, dtype="auto").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    defaults = _recipe_defaults()
    kind = "fused" if "fused" in options else "model" if "model" in options else defaults["loss"]
    chunks = [int(option[5:]) for option in options if option.startswith("chunk")]
    chunk = chunks[0] if chunks else chunk or defaults["loss_chunk_size"]
    loss_fn, line = choose_loss(kind, chunk, model)
    kind = line.split()[1]  # what "auto" chose

    def step(micro_batches):
        train_step(model, micro_batches, context, loss_fn)
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step, {"loss": kind, "chunk": chunk if kind == "fused" else None, "compile": str(context.compile)}


def _recipe_defaults() -> dict:
    """The recipes' defaults of ``train.loss`` and ``train.loss_chunk_size``."""
    from dataclasses import fields

    from automodel.training.config import TrainSection

    return {field.name: field.default for field in fields(TrainSection)}


def _transformers_step(directory: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **_transformers_placement()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    device = _device()

    def step(micro_batches):
        for batch in micro_batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            (model(**batch, use_cache=False).loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step, {"loss": "model", "compile": "False"}


def training(directory: Path, contender: str, args: argparse.Namespace) -> dict:
    """Median step time, tokens/s, MFU and peak GPU memory of one contender."""
    import torch
    import torch.distributed as dist

    from automodel.loading.pipeline import transformers_model
    from automodel.training.metrics import flops_per_token, model_flops_utilization

    base, *options = contender.split("+")
    if base == "automodel":
        model, step_fn, settings = _automodel_step(directory, set(options), args.chunk)
    else:
        model, step_fn, settings = _transformers_step(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = model.config.vocab_size
    times = []
    for index in range(args.warmup + args.steps):
        micro_batches = _batches(index, args, vocab, rank, world)
        _, took = _timed(lambda batches=micro_batches: step_fn(batches))
        times.append(took)
    first, times = times[0], times[args.warmup :]
    seconds = statistics.median(times)
    tokens_per_s = args.global_batch * args.seq / seconds
    flops = flops_per_token(transformers_model(model), args.seq)
    mfu = model_flops_utilization(tokens_per_s, flops, args.peak_tflops if torch.cuda.is_available() else None, world)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    model = step_fn = None  # noqa: F841 (frees the model before the next contender)
    torch.compiler.reset()  # the compiled graphs hold the model's memory
    _free()
    return {
        **settings,
        "first_step_s": round(first, 2),
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the Llama shape (default 1b)")
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="write every result as JSON (rank 0), rewritten after each part")
    parser.add_argument("--parts", default="load,train", help="comma-separated: load, train")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"default: {DEFAULT_CONTENDERS}")
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step (all ranks; 1b: 8, 8b: 4)")
    parser.add_argument("--micro-batch", type=int, help="sequences per micro batch (1b: 2, 8b: 1)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compile happens here)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chunk", type=int, help="tokens per chunk of the fused loss (default: the recipes')")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (MFU)")
    args = parser.parse_args(argv)
    for contender in args.contenders.split(","):
        base, *options = contender.split("+")
        named = {option for option in options if not (option.startswith("chunk") and option[5:].isdigit())}
        if (
            base not in ("automodel", "transformers")
            or named - set(TRAIN_OPTIONS)
            or (base == "transformers" and options)
        ):
            parser.error(
                f"unknown contender {contender!r}: automodel[+{'|+'.join(TRAIN_OPTIONS)}|+chunkN] or transformers"
            )
    batch, micro = (4, 1) if args.shape == "8b" else (8, 2)
    args.global_batch = args.global_batch or batch
    args.micro_batch = args.micro_batch or micro
    if args.tiny:
        args.seq, args.global_batch, args.micro_batch, args.warmup, args.steps = 64, 2, 1, 1, 1
        args.load_repeats, args.chunk = 1, 16
    return args


def _ratios(results: dict) -> None:
    """Each training contender's tokens/s over transformers' and over automodel's (the defaults), in place."""
    train = {
        name.split(":")[1]: row for name, row in results.items() if name.startswith("train:") and "error" not in row
    }
    for peer in ("transformers", "automodel"):
        if peer in train:
            results[f"tokens_per_s_vs_{peer}"] = {
                name: round(row["tokens_per_s"] / train[peer]["tokens_per_s"], 3) for name, row in train.items()
            }


def main() -> None:
    args = parse_args()
    _start(args.tiny)
    import torch
    import torch.distributed as dist

    results: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "shape": "tiny" if args.tiny else args.shape,
        "world_size": dist.get_world_size(),
        "batch": {"global": args.global_batch, "micro": args.micro_batch, "seq": args.seq},
    }
    try:
        import transformers

        results["transformers"] = transformers.__version__
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        holder = [str(args.dir or Path(tmp) / "llama")]
        dist.broadcast_object_list(holder)
        directory = make_checkpoint(Path(holder[0]), TINY if args.tiny else SHAPES[args.shape])
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
            _ratios(results)
            if dist.get_rank() == 0:
                print(json.dumps({name: results[name]}), flush=True)
                if args.out is not None:
                    args.out.write_text(json.dumps(results, indent=2))
    if dist.get_rank() == 0:
        print(
            json.dumps({key: results.get(key) for key in ("tokens_per_s_vs_transformers", "tokens_per_s_vs_automodel")})
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
