"""The ``automodel`` command: ``automodel sft|pretrain --config FILE [--nproc-per-node N] [dotted.key=value ...]``.

The config is read and validated first, against the number of processes too (a bad key or value, or a layout that
does not fit, exits with status 2 before any process starts); then, unless already under torchrun, the command
relaunches itself with ``torchrun --standalone --nproc-per-node N``. ``--print-config`` prints the resolved config.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import yaml

from .config import RECIPES, ConfigError, check_world_size, describe_keys, load_config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="automodel",
        description=__doc__.splitlines()[0],
        epilog=describe_keys() + "\n\nRelative paths in the YAML file are relative to its folder (docs/recipes.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", choices=RECIPES, help="what to run")
    parser.add_argument("--config", required=True, help="YAML recipe config (see docs/recipes.md)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes to start with torchrun (ignored under torchrun)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (defaults filled in) and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. train.lr=3e-4")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``automodel`` console command; returns the exit status."""
    args = _parser().parse_intermixed_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    if args.nproc_per_node < 1 and not under_torchrun:
        print("automodel: --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc_per_node
    try:
        config = load_config(args.config, args.overrides, recipe=args.recipe)
        check_world_size(config, world_size)
    except ConfigError as error:
        print(f"automodel: config error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if not under_torchrun:
        from .loop import prepare_model

        prepare_model(config)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc_per_node}",
            "-m",
            "automodel.training.cli",
            args.recipe,
            "--config",
            args.config,
            *args.overrides,
        ]
        return subprocess.call(command)
    from .loop import run

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    result = run(config)
    if rank == 0:
        print(f"automodel {config.recipe}: {len(result.losses)} steps, final loss {result.losses[-1]:.4f}", flush=True)
        if result.export_dir:
            print(f"automodel {config.recipe}: exported to {result.export_dir}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
