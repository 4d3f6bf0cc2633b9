"""The fused linear cross-entropy against the model-style loss and against the memory floor, on CPU, in one process.

    python benchmarks/loss.py                                  # vocabulary 128256, 4096 tokens, hidden 512, fp32
    python benchmarks/loss.py --rounds 5 --chunks 512,1024,4096 --out loss.json
    python benchmarks/loss.py --device cuda --dtype bfloat16 --tokens 16384 --hidden 2048 --chunks 4096,8192

Each contender is one loss and its backward from a leaf ``hidden`` ``[tokens, hidden]`` and a leaf head ``weight``
``[vocabulary, hidden]`` (a tenth of the targets ignored, as a prompt mask would):

- ``model``: the model-style loss, what transformers computes: ``logits = hidden @ weight.T`` (all of them), then
  ``cross_entropy(logits.float(), targets, reduction="sum") / n``, then ``backward``.
- ``fused/<chunk>``: ``fused_linear_cross_entropy`` with ``chunk`` tokens per chunk (4096 is the recipes' default).
- ``floor``: the loss without logits: ``hidden.sum() + weight.sum()``, whose backward writes the same two gradients.
  Any loss holds at least this much: its inputs (present before the step, not counted) and their gradients.

Memory is the peak resident growth of the process during the loss and its backward (``VmHWM`` reset just before,
minus the resident size then; on CUDA the allocator's peak allocated bytes minus those before), so each contender's
figure includes the gradients it writes. The acceptance bound is
``fused <= floor + one chunk of fp32 logits`` (``chunk x vocabulary x 4`` bytes). Time is wall seconds per loss +
backward, and CPU seconds of the process (every thread: the work done, less sensitive to a shared machine's load);
the contenders run interleaved, round after round, and the medians are reported with each one's ratio.

glibc keeps freed blocks below its (self-raising) mmap threshold for reuse, which would hide later peaks; the script
re-executes itself with ``MALLOC_MMAP_THRESHOLD_`` set so that every large block is returned when freed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MMAP_THRESHOLD = str(1 << 20)
if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})

import torch  # noqa: E402
from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from torch.nn import functional  # noqa: E402

from automodel.training.linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402

MIB = 1 << 20


def model_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> None:
    logits = functional.linear(hidden, weight)
    loss = functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum") / count
    loss.backward()


def fused_loss(chunk: int) -> Callable[..., None]:
    def run(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> None:
        loss = fused_linear_cross_entropy(hidden, weight, None, targets, 1.0 / count, chunk_size=chunk)
        loss.backward()

    return run


def floor_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> None:
    (hidden.sum() + weight.sum()).backward()


def measure(run: Callable[..., None], hidden, weight, targets, count) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this process, every thread) and peak memory growth (bytes) of one loss + backward, the gradients included: resident memory on
    CPU, the caching allocator's allocated bytes on CUDA."""
    hidden.grad = weight.grad = None
    cuda = hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
        reset_peak_rss()
    start, cpu_start = time.perf_counter(), time.process_time()
    run(hidden, weight, targets, count)
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu_seconds, (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - before


def _check(name: str, grads: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tolerance: float) -> None:
    """The fused gradients equal the model-style loss's (a check of what is measured, not a test): the largest
    difference relative to the largest gradient."""
    for ours, theirs in zip(grads, expected, strict=True):
        difference = (ours - theirs).abs().max().item() / max(theirs.abs().max().item(), 1e-30)
        assert difference <= tolerance, f"{name} differs from the model-style loss by {difference} (relative)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunks", default="1024,4096", help="comma-separated chunk sizes of the fused loss")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (then memory is the allocator's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator)
    weight = torch.randn(args.vocab, args.hidden, generator=generator) / args.hidden**0.5
    hidden, weight = (tensor.to(device, dtype).requires_grad_() for tensor in (hidden, weight))
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    targets[torch.rand(args.tokens, generator=generator) < 0.1] = -100
    targets = targets.to(device)
    count = (targets != -100).sum().float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradients' own rounding
    chunks = [int(chunk) for chunk in args.chunks.split(",")]
    contenders: dict[str, Callable[..., None]] = {"floor": floor_loss, "model": model_loss}
    contenders.update({f"fused/{chunk}": fused_loss(chunk) for chunk in chunks})

    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    growth: dict[str, list[int]] = {name: [] for name in contenders}
    expected: tuple[torch.Tensor, torch.Tensor] | None = None
    for _ in range(args.rounds):
        for name, run in contenders.items():
            took, took_cpu, grew = measure(run, hidden, weight, targets, count)
            seconds[name].append(took)
            cpu[name].append(took_cpu)
            growth[name].append(grew)
            print(f"  {name:12s} {took:7.2f} s  {took_cpu:7.2f} CPU s  {grew / MIB:8.0f} MiB", flush=True)
            if name == "model" and expected is None:
                expected = hidden.grad.clone(), weight.grad.clone()
            elif name.startswith("fused/") and len(seconds[name]) == 1:
                _check(name, (hidden.grad, weight.grad), expected, tolerance)

    logits_mib = args.tokens * args.vocab * 4 / MIB
    floor = statistics.median(growth["floor"]) / MIB
    model_s, model_cpu = statistics.median(seconds["model"]), statistics.median(cpu["model"])
    rows = []
    print(
        f"\nvocabulary {args.vocab}, {args.tokens} tokens, hidden {args.hidden}, {args.dtype} on {args.device} "
        f"({torch.get_num_threads()} threads); all fp32 logits: {logits_mib:.0f} MiB; medians of {args.rounds} "
        "interleaved rounds\n"
    )
    print(
        "| loss | s / loss + backward | speed x model | CPU s | speed x model (CPU) | peak growth (MiB) | "
        "above floor (MiB) | one chunk of logits (MiB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in contenders:
        median_s, peak = statistics.median(seconds[name]), statistics.median(growth[name]) / MIB
        median_cpu = statistics.median(cpu[name])
        chunk = int(name.split("/")[1]) if name.startswith("fused/") else None
        bound = min(chunk, args.tokens) * args.vocab * 4 / MIB if chunk else None
        row = {
            "loss": name,
            "seconds": median_s,
            "speed_vs_model": model_s / median_s,
            "cpu_seconds": median_cpu,
            "cpu_speed_vs_model": model_cpu / median_cpu,
            "peak_growth_mib": peak,
            "above_floor_mib": peak - floor,
            "one_chunk_of_logits_mib": bound,
            "seconds_all": seconds[name],
            "cpu_seconds_all": cpu[name],
            "growth_all_mib": [value / MIB for value in growth[name]],
        }
        rows.append(row)
        print(
            f"| `{name}` | {median_s:.2f} | {model_s / median_s:.2f} | {median_cpu:.2f} | {model_cpu / median_cpu:.2f} "
            f"| {peak:.0f} | {peak - floor:.0f} | "
            f"{f'{bound:.0f}' if bound else '—'} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
