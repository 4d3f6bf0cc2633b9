"""``automodel plan --suggest`` and ``automodel sft|pretrain --suggest-layout``: the fastest layouts that fit
(``automodel.suggestion``), and the check before launch that a recipe's own layout fits the GPU.

    automodel plan --model M --world-size N --suggest [--gpu h100 | --gpu-memory 80GiB] [--nproc-per-node 8]
                   [--seq-len S] [--global-batch-tokens T] [--intra-node-gbps G] [--inter-node-gbps G]
                   [--top K] [layout.KEY=VALUE ...] [--json]

``layout.KEY=VALUE`` beside ``--suggest`` pins a searched key (``layout.tp_size=8``) or sets one the search keeps
(``layout.mixed_precision=bf16``); ``--micro-batch-size`` pins the micro batch. The exit status is 0 when a layout
fits, 1 when none does (the answer says why, and the smallest world size that fits), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from typing import Any

from .config import ConfigError, LayoutSection, RecipeConfig

__all__ = [
    "add_gpu_arguments",
    "add_suggest_arguments",
    "check_layout_fits",
    "gpu_memory_bytes",
    "print_suggestions",
    "recipe_candidate",
    "suggest_for_recipe",
]

_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu`` and ``--gpu-memory``: the GPU a layout must fit."""
    from automodel.suggestion.hardware import GPUS

    parser.add_argument("--gpu", choices=sorted(GPUS), help="the GPU (its memory, FLOP/s and links; default h100)")
    parser.add_argument("--gpu-memory", help="one GPU's memory, e.g. 80GiB or 141GB (default: --gpu's)")


def add_suggest_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``automodel plan --suggest``."""
    group = parser.add_argument_group("layout search (--suggest; docs/plan.md)")
    group.add_argument("--suggest", action="store_true", help="print the fastest layouts that fit, best first")
    add_gpu_arguments(group)
    group.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default: seq-len x N)")
    group.add_argument("--intra-node-gbps", type=float, help="NVLink Gbit/s one way per GPU (default: --gpu's)")
    group.add_argument("--inter-node-gbps", type=float, help="network Gbit/s per GPU (default: --gpu's)")
    group.add_argument("--top", type=int, default=5, help="how many layouts to print (default 5)")


def gpu_memory_bytes(gpu: str | None, gpu_memory: str | None, *, visible: bool = False) -> int | None:
    """The memory a layout must fit: ``--gpu-memory``, else ``--gpu``'s, else (``visible``) the smallest visible
    GPU's (``nvidia-smi``, which starts no CUDA context in this process), else ``None``."""
    from automodel.suggestion.hardware import GPUS, parse_bytes

    if gpu_memory is not None:
        return parse_bytes(gpu_memory)
    if gpu is not None:
        return GPUS[gpu].memory_bytes
    return _visible_gpu_memory() if visible else None


def _visible_gpu_memory() -> int | None:
    command = shutil.which("nvidia-smi")
    if command is None:
        return None
    try:
        done = subprocess.run(
            [command, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        sizes = [int(line) for line in done.stdout.split() if line.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) * 2**20 if done.returncode == 0 and sizes else None


def print_suggestions(
    model: str, world_size: int, args: argparse.Namespace, section: LayoutSection, given: set[str]
) -> int:
    """``automodel plan --suggest``: search with the ``given`` searched keys of ``section`` pinned, print the table
    (or ``--json``); 0 when a layout fits, 1 when none does."""
    from automodel.suggestion import suggest
    from automodel.suggestion.candidates import PINNABLE

    from .loop import mesh_arguments

    pins = {key: getattr(section, key) for key in given if key in PINNABLE}
    options = {"seq_len": args.seq_len} if args.seq_len is not None else {}  # else the search's default
    if args.micro_batch_size is not None:
        pins["micro_batch_size"] = args.micro_batch_size
    try:
        result = suggest(
            model,
            world_size=world_size,
            gpu=args.gpu or "h100",
            gpu_memory=gpu_memory_bytes(None, args.gpu_memory),
            nproc_per_node=args.nproc_per_node,
            global_batch_tokens=args.global_batch_tokens,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            layout=_kept(mesh_arguments(section)),
            pins=pins,
            dtype=args.dtype,
            optimizer=args.optimizer,
            top=args.top,
            trust_remote_code=args.trust_remote_code,
            **options,
        )
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"automodel plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0 if result.ok else 1


def _kept(arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``MeshContext.build`` keywords a search keeps as given: the strategy (mixed precision, resharding)."""
    return {key: arguments[key] for key in ("strategy", "compile") if key in arguments}


def suggest_for_recipe(
    config: RecipeConfig, world_size: int, nproc_per_node: int, memory: int | None, gpu: str = "h100", top: int = 5
):
    """``automodel.suggest`` for a recipe's model, batch, sequence length, dtype and mixed precision on
    ``world_size`` processes of ``gpu`` GPUs with ``memory`` bytes each (the layout keys are searched, the rest
    kept)."""
    from automodel.suggestion import suggest

    from .loop import mesh_arguments

    train = config.train
    return suggest(
        config.model.path,
        world_size=world_size,
        gpu=gpu,
        gpu_memory=memory,
        nproc_per_node=nproc_per_node,
        seq_len=train.seq_len,
        global_batch_tokens=train.global_batch_size * train.seq_len,
        layout=_kept(mesh_arguments(config.layout)),
        dtype=_DTYPES[config.model.dtype],
        trainable=config.lora.rank == 0,
        top=top,
        trust_remote_code=config.model.trust_remote_code,
    )


def recipe_candidate(config: RecipeConfig, world_size: int):
    """The recipe's own layout as a search candidate (its micro batch, accumulation and gradient sync)."""
    from automodel.distributed.mesh import check_layout
    from automodel.suggestion.candidates import Candidate

    from .config import pipeline_microbatches

    layout, train = config.layout, config.train
    stage_world = world_size // layout.pp_size
    sizes = check_layout(
        layout.strategy,
        stage_world,
        dp_replicate_size=layout.dp_replicate_size,
        tp_size=layout.tp_size,
        cp_size=layout.cp_size,
        ep_size=layout.ep_size,
        sequence_parallel=layout.sequence_parallel,
    )
    rows = train.global_batch_size // sizes["dp"]
    micro, accumulation = train.micro_batch_size, rows // train.micro_batch_size
    if layout.pp_size > 1:
        accumulation = pipeline_microbatches(config, world_size)
        micro = max(1, rows // accumulation)
    mode = "full" if layout.activation_checkpointing is True else layout.activation_checkpointing
    return Candidate(
        layout.pp_size, layout.dp_replicate_size, sizes["dp_shard"], layout.cp_size, layout.tp_size, layout.ep_size,
        layout.sequence_parallel, mode, layout.pp_schedule, layout.pp_virtual_stages, micro, accumulation,
        train.grad_sync,
    )  # fmt: skip


def check_layout_fits(
    config: RecipeConfig, world_size: int, nproc_per_node: int, memory: int, gpu: str = "h100"
) -> None:
    """Before launch: refuse (``ConfigError``) a recipe whose layout's estimated peak per rank does not fit a GPU of
    ``memory`` bytes (less the search's headroom), naming the best layout that fits, or saying that none does and
    why. FSDP2 layouts only (the planner's figures are FSDP2's)."""
    from automodel.suggestion.memory import HEADROOM
    from automodel.suggestion.report import describe_memory, format_bytes
    from automodel.suggestion.search import layout_memory

    if config.layout.strategy != "fsdp2":
        return
    from .loop import mesh_arguments

    candidate = recipe_candidate(config, world_size)
    verdict = layout_memory(
        config.model.path,
        candidate,
        seq_len=config.train.seq_len,
        memory_bytes=memory,
        layout=_kept(mesh_arguments(config.layout)),
        dtype=_DTYPES[config.model.dtype],
        trainable=config.lora.rank == 0,
        trust_remote_code=config.model.trust_remote_code,
    )
    if verdict.error is not None or verdict.fits:
        return  # a refusal is the layout check's to report (prelaunch), with the real run's message
    parts = verdict.memory
    why = (
        f"the layout ({candidate.describe()}) needs an estimated {format_bytes(parts.peak)} on rank {parts.rank} "
        f"({describe_memory(parts)}), over the {format_bytes(verdict.usable_bytes)} usable of a "
        f"{format_bytes(memory)} GPU ({HEADROOM:.0%} headroom)"
    )
    found = suggest_for_recipe(config, world_size, nproc_per_node, memory, gpu, top=1)
    if found.ok:
        best = found.suggestions[0]
        fix = (
            f"The fastest layout that fits ({format_bytes(best.peak_bytes)} per rank): "
            f"{' '.join(best.candidate.recipe_overrides(found.job))} (`--suggest-layout` lists more)."
        )
    else:
        fix = f"No layout fits: {found.error}"
    raise ConfigError(f"{why}. {fix}")
