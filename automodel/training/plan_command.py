"""``automodel plan``: what each rank of a job would hold, before the job starts (``automodel.plan``).

    automodel plan --model PATH_OR_ID --world-size N [--rank R ...] [--dtype bf16|fp32]
                   [--micro-batch-size B --seq-len S] [--pp-microbatches M] [--optimizer adamw]
                   [layout.KEY=VALUE ...] [--json]

``--nnodes K --nproc-per-node G`` may stand for ``--world-size``. ``--suggest`` prints the fastest layouts that fit
instead (``automodel.training.suggest_command``). The layout keys are the recipes' ``layout`` section; the
activations are estimated for the recipes' default batch (``train.micro_batch_size``, ``train.seq_len``) unless
``--micro-batch-size`` / ``--seq-len`` say otherwise. ``automodel sft|pretrain --config FILE --dry-run`` prints the
same plan for a recipe. The exit status is 0 when the layout fits, 1 when the real run would refuse it (the message
is the one it would raise), 2 for bad arguments and for a model that cannot be resolved or simulated (one line: what
failed, and the fix where there is one).
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import ConfigError, RecipeConfig, TrainSection, layout_from_overrides, parse_overrides
from .suggest_command import add_suggest_arguments, print_suggestions

__all__ = ["main", "print_plan"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="automodel plan",
        description=__doc__.splitlines()[0],
        epilog="layout keys: " + ", ".join(f"layout.{key}" for key in _layout_keys()),
    )
    parser.add_argument("--model", required=True, help="a local checkpoint folder or a hub id (config only)")
    parser.add_argument("--world-size", type=int, help="the job's number of ranks")
    parser.add_argument("--nnodes", type=int, help="nodes (with --nproc-per-node, instead of --world-size)")
    parser.add_argument("--nproc-per-node", type=int, help="ranks per node")
    parser.add_argument("--rank", type=int, action="append", dest="ranks", help="a rank to simulate (repeatable)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the load dtype (default bf16)")
    batch = TrainSection()
    parser.add_argument(
        "--micro-batch-size",
        type=_positive,
        help=f"sequences per rank per forward, for the activation estimate (default {batch.micro_batch_size}, the "
        "recipes' train.micro_batch_size; with --suggest: searched)",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive,
        help=f"tokens per sequence, for the activation estimate (default {batch.seq_len}, the recipes' train.seq_len; "
        "with --suggest: 8192, the search's DEFAULT_SEQ_LEN)",
    )
    parser.add_argument(
        "--pp-microbatches", type=int, help="with layout.pp_size > 1: microbatches per step (default pp_size)"
    )
    parser.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("overrides", nargs="*", metavar="layout.KEY=VALUE")
    add_suggest_arguments(parser)
    return parser


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _layout_keys() -> list[str]:
    import dataclasses

    from .config import LayoutSection

    return [field.name for field in dataclasses.fields(LayoutSection)]


def main(argv: list[str]) -> int:
    """``automodel plan ...``; returns the exit status."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.world_size is None and (args.nnodes is None or args.nproc_per_node is None):
        parser.error("give --world-size N, or --nnodes K with --nproc-per-node G")
    for option in ("world_size", "nnodes", "nproc_per_node"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    world_size = args.world_size if args.world_size is not None else args.nnodes * args.nproc_per_node
    if args.nnodes is not None and args.nproc_per_node is not None and args.nnodes * args.nproc_per_node != world_size:
        parser.error(
            f"--world-size {world_size} is not --nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node} "
            f"({args.nnodes * args.nproc_per_node}): give one or the other, or sizes that agree"
        )
    outside = sorted({rank for rank in args.ranks or () if not 0 <= rank < world_size})
    if outside:
        parser.error(
            f"--rank {', '.join(map(str, outside))}: the ranks of a {world_size}-rank job are 0 to {world_size - 1}"
        )
    try:
        layout = layout_from_overrides(args.overrides)
    except ConfigError as error:
        print(f"automodel plan: {error}", file=sys.stderr)
        return 2
    if args.suggest:
        given = {key.partition(".")[2] for key in parse_overrides(args.overrides)}
        return print_suggestions(args.model, world_size, args, layout, given)
    from .loop import mesh_arguments

    try:
        arguments = mesh_arguments(layout)
    except ValueError as error:
        print(f"automodel plan: {error}", file=sys.stderr)
        return 2
    if args.pp_microbatches is not None:
        if layout.pp_size == 1:
            parser.error("--pp-microbatches applies with layout.pp_size > 1")
        arguments["pp_microbatches"] = args.pp_microbatches
    return print_plan(
        args.model,
        world_size,
        arguments,
        ranks=args.ranks,
        dtype=args.dtype,
        micro_batch_size=args.micro_batch_size or TrainSection().micro_batch_size,
        seq_len=args.seq_len or TrainSection().seq_len,
        optimizer=args.optimizer,
        trust_remote_code=args.trust_remote_code,
        as_json=args.json,
    )


def print_plan(model: str, world_size: int, layout: dict, *, as_json: bool = False, **options) -> int:
    """Plan ``model`` on ``world_size`` ranks with ``layout`` (``MeshContext.build`` keywords), print it; 0 when the
    layout fits, 1 when it is refused."""
    from automodel.planning import SimulationError, plan

    try:
        result = plan(model, world_size=world_size, layout=layout, first_rank_here=True, **options)
    except (ValueError, OSError) as error:  # the model cannot be resolved or read: the loader's one line
        print(f"automodel plan: --model {model}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except SimulationError as error:
        print(f"automodel plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if as_json else result.table())
    return 0 if result.ok else 1


def dry_run(config: RecipeConfig, world_size: int) -> int:
    """``automodel sft|pretrain --dry-run``: the plan of the resolved config on ``world_size`` ranks."""
    from .loop import prepare_model

    prepare_model(config)
    layout, options = plan_arguments(config, world_size)
    return print_plan(
        config.model.path,
        world_size,
        layout,
        micro_batch_size=config.train.micro_batch_size,
        seq_len=config.train.seq_len,
        **options,
    )


def plan_arguments(config: RecipeConfig, world_size: int) -> tuple[dict, dict]:
    """What a recipe config asks of ``automodel.plan``: the layout (``MeshContext.build`` keywords, the pipeline's
    microbatches included) and the model options (``dtype``, ``trust_remote_code``)."""
    from .config import pipeline_microbatches
    from .loop import mesh_arguments

    layout = mesh_arguments(config.layout)
    if config.layout.pp_size > 1:
        layout["pp_microbatches"] = pipeline_microbatches(config, world_size)
    dtypes = {"float32": "fp32", "bfloat16": "bf16"}
    return layout, {"dtype": dtypes[config.model.dtype], "trust_remote_code": config.model.trust_remote_code}
