"""The ``automodel`` command: ``automodel sft|pretrain --config FILE [--nproc-per-node N] [dotted.key=value ...]``.

``automodel init-config sft|pretrain [--output DIR]`` writes a runnable example config and its data set first;
``automodel plan --model PATH_OR_ID --world-size N [layout.KEY=VALUE ...]`` says what each rank of a job would hold
(``--dry-run`` does it for a recipe) before anything starts.

The config is read and validated first, against the number of processes too (a bad key or value, or a layout that
does not fit, exits with status 2 before any process starts); then, unless already under torchrun, the command
relaunches itself with torchrun: ``--standalone`` on one node, or with the rendezvous options it was given
(``--nnodes``, ``--node-rank``, ``--rdzv-backend`` / ``--rdzv-endpoint`` / ``--rdzv-id``, ``--master-addr`` /
``--master-port``) on several. ``--print-config`` prints the resolved config.

The training processes' output passes through the command to the terminal and to a log file in ``log.dir``; when
a rank fails, the command ends with one screen saying which rank, how, and where the log is
(``automodel.training.run_log``). ``automodel prepare-data`` tokenizes a corpus once for training at scale
(``automodel.training.prepare_data``).

A SIGTERM or SIGUSR1 to the command is passed on to the training processes, which save a checkpoint after their
current step and end; the command then exits with status 0 (see ``automodel.training.preemption``). Ctrl-C does the
same and exits with status 130; a second Ctrl-C stops at once without saving. With ``export.push_to_hub`` the
command uploads the export once the processes have ended (``automodel.training.hub_upload``) and exits with status 3
when that upload fails. ``automodel --help`` lists the commands and every exit status (``commands.py``).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import yaml

from .commands import COMMANDS, overview, unknown_command
from .config import RECIPES, ConfigError, check_world_size, load_config
from .config_help import describe_keys
from .suggest_command import add_gpu_arguments

__all__ = ["main"]


def _parser(recipe: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; its help lists ``recipe``'s config keys (``automodel sft --help``), or says how to."""
    keys = (
        describe_keys(recipe) if recipe else "`automodel sft --help` and `automodel pretrain --help` list their keys."
    )
    parser = argparse.ArgumentParser(
        prog=f"automodel {recipe}" if recipe else "automodel",
        description=__doc__.splitlines()[0],
        epilog=keys
        + "\n\nRelative paths in the YAML file, and the default log.dir, are relative to its folder; paths given as"
        + " key=value on the command line are relative to the current directory (docs/recipes.md)."
        + "\n`automodel --help` lists the commands and the exit statuses.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if recipe is None:
        parser.add_argument("recipe", choices=RECIPES, help="what to run")
    parser.add_argument("--config", required=True, help="YAML recipe config (see docs/recipes.md)")
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        help="processes to start on this node with torchrun (default 1; ignored under torchrun)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the processes this many times when one dies (torchrun's --max-restarts); each restart "
        "resumes from the newest complete checkpoint in checkpoint.dir",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (defaults filled in) and exit"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what each rank would hold (automodel plan, simulated in this process) and start nothing",
    )
    parser.add_argument(
        "--suggest-layout",
        action="store_true",
        help="print the fastest layouts that fit the GPU for this config's model and launch size, and start nothing",
    )
    add_gpu_arguments(parser)
    nodes = parser.add_argument_group("several nodes (passed to torchrun; docs/recipes.md#several-nodes)")
    nodes.add_argument("--nnodes", type=int, default=1, help="number of nodes, each running this command")
    nodes.add_argument(
        "--node-rank", "--node_rank", type=int, help="this node's rank (static rendezvous with --master-addr)"
    )
    nodes.add_argument("--rdzv-backend", "--rdzv_backend", help="rendezvous backend, e.g. c10d")
    nodes.add_argument("--rdzv-endpoint", "--rdzv_endpoint", help="rendezvous host:port, the same on every node")
    nodes.add_argument("--rdzv-id", "--rdzv_id", help="job id shared by the nodes of one run")
    nodes.add_argument("--master-addr", "--master_addr", help="address of the node of rank 0 (static rendezvous)")
    nodes.add_argument(
        "--master-port", "--master_port", type=int, help="port on the node of rank 0 (static rendezvous)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. train.lr=3e-4")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``automodel`` console command; returns the exit status (``commands.EXIT_STATUSES``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        print(unknown_command(argv[0]), file=sys.stderr)
        return 2
    if argv[:1] == ["init-config"]:
        from .init_config import main as init_config

        return init_config(argv[1:])
    if argv[:1] == ["prepare-data"]:
        from .prepare_data import main as prepare_data

        return prepare_data(argv[1:])
    if argv[:1] == ["plan"]:
        from .plan_command import main as plan_command

        return plan_command(argv[1:])
    recipe = argv[0] if argv[:1] and argv[0] in RECIPES else None
    args = _parser(recipe).parse_intermixed_args(argv[1:] if recipe else argv)
    args.recipe = recipe or args.recipe
    under_torchrun = "LOCAL_RANK" in os.environ
    if ((args.nproc_per_node is not None and args.nproc_per_node < 1) or args.nnodes < 1) and not under_torchrun:
        print("automodel: --nproc-per-node and --nnodes must be at least 1", file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print("automodel: --max-restarts must be 0 or more", file=sys.stderr)
        return 2
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else (args.nproc_per_node or 1) * args.nnodes
    try:
        config = load_config(args.config, args.overrides, recipe=args.recipe)
        check_world_size(config, world_size)
    except ConfigError as error:
        print(f"automodel: config error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if args.dry_run and not under_torchrun:
        from .plan_command import dry_run

        return dry_run(config, world_size)
    if args.suggest_layout and not under_torchrun:
        return _suggest_layout(args, config, world_size)
    if not under_torchrun:
        return _launch(args, config)
    return _train(config)


def _checked_before_launch(args: argparse.Namespace, config) -> bool:
    """The checks of ``prelaunch`` (printing the error and returning False when one fails), the warnings, and how
    many processes start when ``--nproc-per-node`` was left out."""
    from .prelaunch import check_before_launch

    try:
        warnings = check_before_launch(config, (args.nproc_per_node or 1) * args.nnodes)
    except ConfigError as error:
        print(f"automodel: config error: {error}", file=sys.stderr)
        return False
    for warning in warnings:
        print(f"automodel: warning: {warning}", file=sys.stderr)
    if not _fits_the_gpu(args, config):
        return False
    if args.nproc_per_node is None:
        print(
            f"automodel: starting 1 process on this node (no --nproc-per-node given){_devices_hint()}",
            file=sys.stderr,
        )
    return True


def _gpu_memory(args: argparse.Namespace) -> int | None:
    """``--gpu-memory``, ``--gpu``'s memory, or the visible GPU's (``None`` on a machine without one)."""
    from .suggest_command import gpu_memory_bytes

    return gpu_memory_bytes(args.gpu, args.gpu_memory, visible=True)


def _fits_the_gpu(args: argparse.Namespace, config) -> bool:
    """The layout's estimated peak per rank against the GPU (``suggest_command.check_layout_fits``): printing the
    refusal, with the fastest layout that fits, and returning False when it does not fit."""
    from .suggest_command import check_layout_fits

    try:
        memory = _gpu_memory(args)
        if memory is not None:
            world_size = (args.nproc_per_node or 1) * args.nnodes
            check_layout_fits(config, world_size, args.nproc_per_node or 1, memory, args.gpu or "h100")
    except (ConfigError, ValueError) as error:
        print(f"automodel: config error: {error}", file=sys.stderr)
        return False
    return True


def _suggest_layout(args: argparse.Namespace, config, world_size: int) -> int:
    """``automodel sft|pretrain --suggest-layout``: the table of ``automodel plan --suggest`` for the config."""
    from .loop import prepare_model
    from .suggest_command import suggest_for_recipe

    prepare_model(config)  # the tiny smoke-test model, where model.tiny_if_missing asks for it
    try:
        memory = _gpu_memory(args)
        if memory is None:
            raise ValueError("no GPU is visible here: give --gpu-memory 80GiB or --gpu h100|h200|a100-80g|b200")
        result = suggest_for_recipe(config, world_size, args.nproc_per_node or 1, memory, args.gpu or "h100")
    except (ValueError, OSError) as error:
        print(f"automodel: {error}", file=sys.stderr)
        return 2
    print(result.table())
    return 0 if result.ok else 1


def _devices_hint() -> str:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"; this node has {count} GPUs: pass --nproc-per-node {count} to use them all" if count > 1 else ""


def _launch(args: argparse.Namespace, config) -> int:
    """Start torchrun with this command on every process; pass preemption signals on; its exit status."""
    from .hub_upload import UPLOAD_REQUEST_VARIABLE, finish_requested_upload
    from .preemption import forward_signals, launcher_settings
    from .run_log import RunLog

    if not _checked_before_launch(args, config):
        return 2
    torchrun_options, preexec = launcher_settings()
    command = [
        sys.executable,
        "-m",
        "automodel.training.launch",  # torchrun, telling the log of each failed worker (a restart or the end)
        *torchrun_options,
        *_rendezvous_options(args),
        f"--nproc-per-node={args.nproc_per_node or 1}",
        f"--max-restarts={args.max_restarts}",
        "-m",
        "automodel.training.cli",
        args.recipe,
        "--config",
        args.config,
        *args.overrides,
    ]
    log = RunLog(
        Path(config.log.dir).absolute(),
        config.recipe,
        max_restarts=args.max_restarts,
        single_node=args.nnodes == 1,
    )
    requests = Path(tempfile.mkdtemp(prefix="automodel-upload-"))  # rank 0 asks here for export.push_to_hub
    process = subprocess.Popen(  # no threads yet
        command,
        preexec_fn=preexec,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # a read returns what the pipe holds, as it comes
        env={**os.environ, **log.environment(), UPLOAD_REQUEST_VARIABLE: str(requests / "request.json")},
    )
    log.pump(process.stdout, sys.stdout)
    log.pump(process.stderr, sys.stderr)
    received = forward_signals(process.pid)
    status = process.wait()
    for line in log.finish(status, args.recipe, signalled=bool(received)):
        print(line, file=sys.stderr, flush=True)
    uploaded = finish_requested_upload(requests / "request.json", args.recipe) if status == 0 else None
    shutil.rmtree(requests, ignore_errors=True)
    if status == 0 and signal.SIGINT in received:
        return 128 + signal.SIGINT  # saved and stopped cleanly, but interrupted: the shell's status for Ctrl-C
    if uploaded:
        return uploaded  # trained and exported; the upload failed
    return 128 - status if status < 0 else status  # killed by a signal: the shell's 128 + signal number


def _rendezvous_options(args: argparse.Namespace) -> list[str]:
    options = {
        "--node-rank": args.node_rank,
        "--rdzv-backend": args.rdzv_backend,
        "--rdzv-endpoint": args.rdzv_endpoint,
        "--rdzv-id": args.rdzv_id,
        "--master-addr": args.master_addr,
        "--master-port": args.master_port,
    }
    given = [f"{flag}={value}" for flag, value in options.items() if value is not None]
    if args.nnodes == 1 and not given:
        return ["--standalone"]
    return [f"--nnodes={args.nnodes}", *given]


def _train(config) -> int:
    """One training process (under torchrun): run the recipe; 0, or 128 + the signal that stopped it without a
    checkpoint."""
    import torch.distributed as dist

    from .loop import run
    from .preemption import describe, restore_default_handlers

    restore_default_handlers()
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    result = run(config)
    status = 0
    if rank == 0:
        name = config.recipe
        if result.preempted is not None:
            saved = f"checkpoint {result.checkpoint}" if result.checkpoint else "no checkpoint (checkpoint.dir unset)"
            how = describe(signal.Signals[result.preempted])
            verb = "interrupted by" if how == "Ctrl-C" else "stopped by"
            print(f"automodel {name}: {verb} {how} after step {len(result.losses)}; {saved}", flush=True)
        else:
            print(
                f"automodel {name}: {len(result.losses)} step{'' if len(result.losses) == 1 else 's'}, final loss {result.losses[-1]:.4f}",
                flush=True,
            )
            if result.checkpoint:
                print(f"automodel {name}: newest checkpoint {result.checkpoint}", flush=True)
        if result.export_dir:
            print(f"automodel {name}: exported to {result.export_dir}", flush=True)
        if config.train.tensorboard_dir:
            print(f"automodel {name}: TensorBoard logs in {config.train.tensorboard_dir}", flush=True)
    if result.preempted is not None and result.checkpoint is None:
        status = 128 + (
            signal.Signals[result.preempted].value if result.preempted in signal.Signals.__members__ else 15
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


def _exit_without_teardown(status: int) -> NoReturn:
    """End a training process whose work is done and written: Python's exit handlers run (logging, temporary files),
    then the process exits without the interpreter's and the native libraries' teardown.

    That teardown has nothing left to release that the OS does not, and it can abort: a gloo worker thread that
    releases a just-finished collective's tensor needs the GIL, and if the interpreter is shutting down by then the
    process ends with SIGABRT ("terminate called without an active exception"; about 1 run in 10 of two side-by-side
    loops of two-rank runs with torch 2.12.1). torchrun would report that finished run as failed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _main_under_torchrun() -> NoReturn:
    """A training process: its failure is reported to the ``automodel`` command (``run_log``) before the traceback."""
    from .run_log import report_failure

    try:
        exit_status = main()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is not an Exception
        report_failure(error, int(os.environ.get("RANK", 0)))
        raise
    _exit_without_teardown(exit_status)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        _main_under_torchrun()
    sys.exit(main())
