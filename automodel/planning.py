"""Plan before you pay: ``automodel.plan(model, world_size=N, layout=...)`` runs the project's own build-on-meta and
``parallelize`` for simulated ranks of an N-rank job, each in a child process under torch's fake process group (every
collective returns at once), and reports what each rank would hold: its parameter shards, gradients, optimizer
states, the bytes it reads from the checkpoint, its largest FSDP all-gather, an activation estimate and a peak.

No parameter memory is allocated (the model stays on the meta device) and no checkpoint data is read (only the
safetensors headers, where the files are present). Every figure comes from the objects the real run builds: the
``DTensor`` local shapes, FSDP2's own padded shards and all-gather sizes, the loader's own read plan. A layout the
real run refuses is refused here with the real run's message, since it is the same code that raises.

Which ranks: without ``ranks``, rank 0, the last rank, and one rank of every class of ranks whose local shards have
the same shapes (the first and last chunks of an uneven split, the ranks past its end, ...); each result says which
ranks it stands for. Simulating a rank of an 8,192-rank job takes seconds (most of it torch's ``fully_shard``, whose
cost per parameter grows with the shard group: ``docs/performance.md``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from automodel._compat.torch import FakeStore, fsdp_sizes
from automodel.activation_estimate import activation_bytes
from automodel.distributed import MeshContext
from automodel.distributed.mesh import forget_meshes
from automodel.distributed.parallelizer import parallelizer_for
from automodel.loading.initialization import local_view
from automodel.loading.placements import rank_classes
from automodel.loading.quantized import pop_quantization_scheme
from automodel.loading.sharded_loader import count_reads

__all__ = ["Plan", "RankPlan", "layout_refusal", "plan"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
#: Optimizer state bytes per trainable local element: AdamW keeps two fp32 moments (``exp_avg``, ``exp_avg_sq``).
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0}


@dataclass(frozen=True)
class RankPlan:
    """What one simulated rank holds (bytes; see ``docs/plan.md`` for how each figure is made)."""

    rank: int
    stands_for: list[int] | str  # the ranks with the same local shapes ("512 ranks: 0-511" past 16 of them)
    param_bytes: int  # this rank's local parameter shards, in the load dtype
    padded_param_bytes: int  # what FSDP2 allocates for them (dim-0 shards padded to a multiple of the group)
    grad_bytes: int  # trainable local shards, in the parameter dtype
    optimizer_bytes: int  # the optimizer's states for the trainable local elements
    checkpoint_read_bytes: int | None  # what the loader reads for this rank (None: no checkpoint files present)
    largest_gather_bytes: int  # the largest FSDP unit unsharded: the all-gather buffer it needs
    activation_bytes_estimate: int | None  # given micro_batch_size and seq_len, with the AC setting
    peak_bytes_estimate: int
    # Under PP: this rank's stages, their decoder layers, and the microbatches whose activations it holds at once
    # (the activation estimate counts them).
    pipeline_stages: list[int] | None = None
    pipeline_layers: int | None = None
    in_flight_microbatches: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this rank."""
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The plan of one layout: ``ok`` and ``error`` (the exact message the real run would raise), the model's total
    parameter bytes, one :class:`RankPlan` per simulated rank class, and the lines the parallelizer logs."""

    world_size: int
    ok: bool
    error: str | None
    total_param_bytes: int
    ranks: list[RankPlan] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)
    #: What each simulation cost: ``{"rank", "seconds", "peak_rss_bytes"}`` per simulated rank (its own process).
    simulation: list[dict[str, Any]] = field(default_factory=list)
    #: Under PP: ``{"schedule", "stages", "ranks", "virtual_stages", "microbatches", "layers_per_stage", "bubble"}``
    #: (``bubble``: the ideal idle share of a step, ``(P - 1) / (V M + P - 1)``).
    pipeline: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``automodel plan --json`` prints."""
        return {**asdict(self), "ranks": [rank.to_dict() for rank in self.ranks]}

    def table(self) -> str:
        """A readable report: the verdict, the log lines, and one row per rank class."""
        layout = ", ".join(f"{key}={value}" for key, value in self.layout.items())
        head = [f"plan: {self.world_size} ranks ({layout}), model {_gib(self.total_param_bytes)} of parameters"]
        if not self.ok:
            return "\n".join([*head, f"refused: {self.error}"])
        head += [f"  {line}" for line in self.log]
        if self.pipeline is not None:
            pipeline = self.pipeline
            head.append(
                f"  pipeline: {pipeline['schedule']}, {pipeline['stages']} stages over {pipeline['ranks']} pipeline "
                f"ranks, {pipeline['microbatches']} microbatches per step, decoder layers per stage "
                f"{pipeline['layers_per_stage']}; ideal bubble {pipeline['bubble']:.1%} of a step"
            )
        columns = (
            "rank",
            "params",
            "padded",
            "grads",
            "optimizer",
            "ckpt read",
            "largest gather",
            "activations",
            "peak",
            "stands for",
        )
        rows = [columns]
        for rank in self.ranks:
            rows.append(
                (
                    str(rank.rank),
                    _gib(rank.param_bytes),
                    _gib(rank.padded_param_bytes),
                    _gib(rank.grad_bytes),
                    _gib(rank.optimizer_bytes),
                    "-" if rank.checkpoint_read_bytes is None else _gib(rank.checkpoint_read_bytes),
                    _gib(rank.largest_gather_bytes),
                    "-" if rank.activation_bytes_estimate is None else _gib(rank.activation_bytes_estimate),
                    _gib(rank.peak_bytes_estimate),
                    _describe_ranks(rank.stands_for),
                )
            )
            if self.pipeline is not None:
                rows[-1] = (
                    *rows[-1][:-1],
                    f"{rank.pipeline_stages} ({rank.pipeline_layers} layers, {rank.in_flight_microbatches:g} in flight)",
                    rows[-1][-1],
                )
        if self.pipeline is not None:
            rows[0] = (*columns[:-1], "stages", columns[-1])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
        return "\n".join([*head, "", *lines])


def plan(
    model: str | os.PathLike,
    *,
    world_size: int,
    layout: Mapping[str, Any] | None = None,
    ranks: Sequence[int] | None = None,
    dtype: str | torch.dtype = "bf16",
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    trust_remote_code: bool = False,
) -> Plan:
    """Plan ``model`` (a local checkpoint folder or a hub id: its config, and the safetensors headers where the
    files are present) on ``world_size`` ranks with ``layout`` (the keyword arguments of ``MeshContext.build``:
    ``strategy``, ``dp_replicate_size``, ``tp_size``, ``cp_size``, ``ep_size``, ``sequence_parallel``,
    ``activation_checkpointing`` ...). ``ranks`` picks the simulated ranks (default: a representative set).

    Each simulated rank runs in a fresh child process under torch's fake process group (up to 4 at a time), so
    this works from any process, one that runs a real process group included.
    """
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {sorted(_OPTIMIZER_STATE_BYTES)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype))
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)}.")
    request = _Request(
        str(model), world_size, dict(layout or {}), torch_dtype, micro_batch_size, seq_len, optimizer, trust_remote_code
    )
    first = _simulate_elsewhere(request, ranks[0] if ranks else 0, classes=not ranks)
    layout = _shown_layout(request.layout)
    if first["error"] is not None:
        return Plan(world_size, False, first["error"], first["total_param_bytes"], layout=layout)
    if ranks:
        chosen = {rank: [rank] for rank in ranks}
    elif first["pipeline"] is not None:
        chosen = _pipeline_ranks(first["classes"], first["pipeline"]["ranks"], world_size)
    else:
        # Each class by its first rank, the last rank's class by the last rank.
        chosen = {members[-1] if members[-1] == world_size - 1 else members[0]: members for members in first["classes"]}
    if first["rank"] not in chosen:  # rank 0 and the last one in one class of several: both are shown
        chosen[first["rank"]] = chosen[world_size - 1]
    others = [rank for rank in chosen if rank != first["rank"]]
    with ThreadPoolExecutor(max_workers=max(1, min(len(others), os.cpu_count() or 1, 4))) as pool:
        outcomes = [first, *pool.map(lambda rank: _simulate_elsewhere(request, rank, classes=False), others)]
    failed = next((outcome for outcome in outcomes if outcome["error"] is not None), None)
    if failed is not None:
        return Plan(world_size, False, failed["error"], first["total_param_bytes"], layout=layout)
    results = sorted(
        (_standing_for(RankPlan(**outcome["figures"]), chosen[outcome["rank"]]) for outcome in outcomes),
        key=lambda result: result.rank,
    )
    costs = [{key: outcome[key] for key in ("rank", "seconds", "peak_rss_bytes")} for outcome in outcomes]
    return Plan(
        world_size, True, None, first["total_param_bytes"], results, first["log"], layout, costs, first["pipeline"]
    )


def layout_refusal(
    model: str | os.PathLike,
    *,
    world_size: int,
    layout: Mapping[str, Any] | None = None,
    dtype: str | torch.dtype = "bf16",
    trust_remote_code: bool = False,
) -> str | None:
    """Why the real run would refuse ``layout`` for ``model`` on ``world_size`` ranks, or ``None`` when it fits.

    Rank 0 is simulated as :func:`plan` simulates it (the same build on meta, the same ``parallelize`` or pipeline
    split, so the same checks: heads against TP, experts against EP, layers against PP ...), without the other
    ranks' figures. In this process when it runs no process group (the ``automodel`` command before it starts
    torchrun: no helper process to start, a second or two for a model of any size), else in a forked child.
    """
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES[str(dtype)]
    request = _Request(str(model), world_size, dict(layout or {}), torch_dtype, None, None, "adamw", trust_remote_code)
    if dist.is_available() and dist.is_initialized():
        return _simulate_elsewhere(request, 0, classes=False)["error"]
    threads = torch.get_num_threads()
    try:
        return _simulate_here(request, 0, classes=False)["error"]
    finally:
        torch.set_num_threads(threads)


def _pipeline_ranks(classes: list[list[int]], pp_size: int, world_size: int) -> dict[int, list[int]]:
    """Under PP, every pipeline rank's stage group (each holds other stages, so each is simulated) by the classes
    of the first group, shifted into it: the first rank of each class."""
    per_group = world_size // pp_size
    in_group = [[rank for rank in members if rank < per_group] for members in classes]
    in_group = [members for members in in_group if members]
    chosen: dict[int, list[int]] = {}
    for group in range(pp_size):
        offset = group * per_group
        for members in in_group:
            shifted = [offset + rank for rank in members]
            chosen[shifted[0]] = shifted
    return chosen


@dataclass(frozen=True)
class _Request:
    model: str
    world_size: int
    layout: dict[str, Any]
    dtype: torch.dtype
    micro_batch_size: int | None
    seq_len: int | None
    optimizer: str
    trust_remote_code: bool


def _simulate_elsewhere(request: _Request, rank: int, *, classes: bool) -> dict[str, Any]:
    """One simulated rank in a fresh process (see :class:`_ForkServer`).

    A fresh process per rank, because one process cannot be two ranks in a row: device meshes compare equal by
    their layout alone, not by the rank that built them, so DTensor's sharding caches (in Python and C++) would hand
    the second rank meshes of the first, with the first rank's coordinates.
    """
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.process.poll() is not None:
            _SERVER = _ForkServer()
        server = _SERVER
    kind, value = server.run((request, rank, classes))
    if kind != "ok":
        raise RuntimeError(f"Simulating rank {rank} of {request.world_size} failed: {value}")
    return value


class _ForkServer:
    """A helper process that imports the libraries once and forks one fresh child per simulated rank.

    Why not ``multiprocessing``: its spawn and forkserver contexts run the caller's ``__main__`` again in every
    child (a script without an ``if __name__ == "__main__"`` guard would plan recursively), and starting a fresh
    interpreter per rank costs the 5-9 s of importing torch and transformers each time. The helper reads one job
    per line (a request file and a result file) and answers with the child's pid; the child writes its result and
    exits, and the helper never runs a process group itself.
    """

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from automodel.planning import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lock = threading.Lock()
        atexit.register(self.close)

    def run(self, job: tuple) -> tuple[str, Any]:
        with tempfile.TemporaryDirectory() as folder:
            job_file, result_file = Path(folder) / "job.pickle", Path(folder) / "result.pickle"
            job_file.write_bytes(pickle.dumps(job))
            with self.lock:
                self.process.stdin.write(f"{job_file}\t{result_file}\n")
                self.process.stdin.flush()
                answer = self.process.stdout.readline()
            if not answer.strip().isdigit():
                return "error", f"the planning helper process ended (exit code {self.process.poll()})"
            pid = int(answer)
            while _alive(pid):
                time.sleep(0.02)
            if not result_file.is_file():
                return "error", f"the simulating process {pid} died without a result (killed, or out of memory?)"
            return pickle.loads(result_file.read_bytes())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_SERVER: _ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve() -> None:
    """The helper's loop (see :class:`_ForkServer`): fork one child per job line on stdin, print its pid."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    for line in sys.stdin:
        job_file, result_file = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            _run_child(Path(job_file), Path(result_file))
        print(pid, flush=True)


def _run_child(job_file: Path, result_file: Path) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # the helper's stdout is its answer channel
    try:
        outcome = ("ok", _simulate_here(*pickle.loads(job_file.read_bytes())))
    except BaseException:  # the parent raises it
        outcome = ("error", traceback.format_exc())
    partial = result_file.with_suffix(".part")
    partial.write_bytes(pickle.dumps(outcome))
    os.replace(partial, result_file)
    os._exit(0)


def _shown_layout(layout: dict[str, Any]) -> dict[str, Any]:
    """The layout as reported: the strategy and the keys that differ from ``MeshContext.build``'s defaults."""
    defaults = {"dp_replicate_size": 1, "tp_size": 1, "cp_size": 1, "ep_size": 1}
    strategy = layout.get("strategy", "fsdp2")
    shown: dict[str, Any] = {"strategy": getattr(strategy, "name", strategy)}
    if getattr(strategy, "param_dtype", None) is not None:
        shown["param_dtype"] = str(strategy.param_dtype).removeprefix("torch.")
    for key, value in layout.items():
        if key != "strategy" and value not in (defaults.get(key), False, None, "fp32"):
            shown[key] = value if isinstance(value, (int, bool, str)) else str(value)
    return shown


def _standing_for(figures: RankPlan, members: list[int]) -> RankPlan:
    described = members if len(members) <= 16 else f"{len(members)} ranks: {_ranges(members)}"
    return replace(figures, stands_for=described)


def _simulate_here(request: _Request, rank: int, classes: bool) -> dict[str, Any]:
    """What a child process computes for one rank (see :func:`_simulate_elsewhere`)."""
    torch.set_num_threads(1)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a simulated rank needs a process without a process group")
    start = time.perf_counter()
    target = _Target.resolve(request.model, request.trust_remote_code, request.dtype)
    layout = _mesh_arguments(request.layout)
    simulation = _Simulation(
        target, request.world_size, layout, request.micro_batch_size, request.seq_len, request.optimizer
    )
    outcome = simulation.rank(rank, classes=classes)
    return {
        "rank": rank,
        "error": outcome.error,
        "figures": None if outcome.figures is None else asdict(outcome.figures),
        "classes": outcome.classes,
        "log": outcome.log,
        "pipeline": outcome.pipeline,
        "total_param_bytes": target.total_bytes,
        "seconds": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _mesh_arguments(layout: dict[str, Any]) -> dict[str, Any]:
    """``layout`` as ``MeshContext.build`` keywords; ``mixed_precision: bf16`` (the recipes' key) is FSDP2 computing
    in bf16 with fp32 gradient reduction, as the recipes build it."""
    arguments = dict(layout)
    if arguments.pop("mixed_precision", "fp32") == "bf16":
        from automodel.distributed import FSDP2Config

        arguments["strategy"] = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return arguments


# ----------------------------------------------------------------------------------------------------------------
# What is planned: the model's config, class and checkpoint files.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Target:
    config: PretrainedConfig
    auto_class: type
    directory: Path | None  # a folder holding the weights, whose headers the read plan uses
    dtype: torch.dtype
    trust_remote_code: bool
    quantized: bool
    total_bytes: int = 0

    @classmethod
    def resolve(cls, model: str | os.PathLike, trust_remote_code: bool, dtype: torch.dtype) -> _Target:
        from automodel.auto_model import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText, load_config
        from automodel.loading.hub import HubOptions, resolve_config_dir

        directory = resolve_config_dir(model, HubOptions(trust_remote_code=trust_remote_code))
        config = load_config(model, directory, trust_remote_code, {})
        quantized = pop_quantization_scheme(config) is not None
        vision = getattr(config, "vision_config", None) is not None
        image_text = type(config) in NeMoAutoModelForImageTextToText._auto_mapping
        auto_class = NeMoAutoModelForImageTextToText if vision and image_text else NeMoAutoModelForCausalLM
        weights = directory if _has_weights(directory) else None
        target = cls(config, auto_class, weights, dtype, trust_remote_code, quantized)
        target.total_bytes = sum(p.numel() * p.element_size() for p in target.build().parameters())
        return target

    def build(self) -> nn.Module:
        return self.auto_class._build_on_meta(self.config, self.dtype, None, self.trust_remote_code)


def _has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds every weight file of a checkpoint (headers only are enough)."""
    from automodel.loading import CheckpointError, open_checkpoint

    try:
        open_checkpoint(directory).close()
    except (CheckpointError, FileNotFoundError, OSError):
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# One simulated rank.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    rank: int
    error: str | None = None
    figures: RankPlan | None = None
    log: list[str] = field(default_factory=list)
    classes: list[list[int]] = field(default_factory=list)
    pipeline: dict[str, Any] | None = None


@dataclass
class _Simulation:
    target: _Target
    world_size: int
    layout: dict[str, Any]
    micro_batch_size: int | None
    seq_len: int | None
    optimizer: str

    def rank(self, rank: int, *, classes: bool) -> _Outcome:
        """Build, check the checkpoint, build the mesh and parallelize as rank ``rank`` would; its figures."""
        outcome = _Outcome(rank)
        if not 0 <= rank < self.world_size:
            outcome.error = f"rank {rank} is not a rank of a {self.world_size}-rank job."
            return outcome
        with _fake_process_group(rank, self.world_size), _captured_log() as log:
            stages: _Stages | None = None
            try:
                model = self.target.build()
                checkpoint = self._checkpoint_plan(model)
                context = MeshContext.build(**self.layout)
                if context.pipeline is not None:
                    stages = _Stages.build(model, context)
                    model = stages.modules
                else:
                    model = parallelizer_for(model).parallelize(model, context)
            except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
                outcome.error = str(error)
                return outcome
            read_bytes = None
            if checkpoint is not None:
                read_bytes = stages.reads(checkpoint) if stages else count_reads(model, checkpoint.keys.sources)
                checkpoint.files.close()
            outcome.figures = self._figures(rank, model, context, read_bytes, stages)
            outcome.classes = rank_classes(model, self.world_size) if classes else []
            outcome.log = list(log)
            outcome.pipeline = stages.facts(context) if stages else None
        return outcome

    def _checkpoint_plan(self, model: nn.Module):
        if self.target.directory is None or self.target.quantized:
            return None
        from automodel.loading.loader import plan_checkpoint

        return plan_checkpoint(model, self.target.directory)

    def _figures(
        self, rank: int, model: nn.Module, context: MeshContext, read_bytes: int | None, stages: _Stages | None
    ) -> RankPlan:
        params = list(model.parameters())
        local = [(local_view(p).numel() * p.element_size(), p) for p in params]
        trainable = [(size, p) for size, p in local if p.requires_grad]
        grad_bytes = sum(size for size, _ in trainable)
        optimizer = sum(local_view(p).numel() for _, p in trainable) * _OPTIMIZER_STATE_BYTES[self.optimizer]
        padded, largest_gather = _fsdp_sizes(model, params)
        activations = _activation_estimate(
            context, self.target.config, self.micro_batch_size, self.seq_len, self.target.dtype, stages
        )
        # Two all-gather buffers: the unit running and the one prefetched.
        peak = padded + grad_bytes + optimizer + 2 * largest_gather + (activations or 0)
        return RankPlan(
            rank=rank,
            stands_for=[rank],
            param_bytes=sum(size for size, _ in local),
            padded_param_bytes=padded,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer,
            checkpoint_read_bytes=read_bytes,
            largest_gather_bytes=largest_gather,
            activation_bytes_estimate=activations,
            peak_bytes_estimate=peak,
            pipeline_stages=None if stages is None else list(context.pipeline.local_stages),
            pipeline_layers=None if stages is None else stages.local_layers(context),
            in_flight_microbatches=None if stages is None else context.pipeline.in_flight(),
        )


@dataclass
class _Stages:
    """This rank's pipeline stages, parallelized on meta as the real load builds them."""

    modules: nn.ModuleList
    split: Any  # automodel.loading.pipeline_stages.StageSplit
    aliases: dict[str, str]

    @classmethod
    def build(cls, model: nn.Module, context: MeshContext) -> _Stages:
        from automodel.loading.pipeline_stages import parallelized_stage, split_into_stages, tied_aliases

        split = split_into_stages(model, context)
        stages = [parallelized_stage(model, split, index, context) for index in context.pipeline.local_stages]
        return cls(nn.ModuleList(stages), split, tied_aliases(model))

    def reads(self, checkpoint) -> int:
        from automodel.loading.pipeline_stages import stage_checkpoint_plan

        return sum(
            count_reads(stage, stage_checkpoint_plan(checkpoint, stage, self.aliases).keys.sources)
            for stage in self.modules
        )

    def local_layers(self, context: MeshContext) -> int:
        return sum(self.split.layer_counts[index] for index in context.pipeline.local_stages)

    def facts(self, context: MeshContext) -> dict[str, Any]:
        layout = context.pipeline
        return {
            "schedule": layout.schedule,
            "stages": layout.num_stages,
            "ranks": layout.size,
            "virtual_stages": layout.virtual_stages,
            "microbatches": layout.microbatches,
            "layers_per_stage": list(self.split.layer_counts),
            "bubble": layout.ideal_bubble(),
        }


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        forget_meshes()
        dist.destroy_process_group()


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    """The lines the project logs meanwhile (the parallelizer's checklist: rank 0 only)."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("automodel")
    handler, level = _Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _fsdp_sizes(model: nn.Module, params: list[nn.Parameter]) -> tuple[int, int]:
    """(bytes FSDP2 allocates for this rank's shards, padding included, plus the parameters it does not manage;
    the largest unit's all-gather output in bytes)."""
    padded, largest = fsdp_sizes(model)
    unmanaged = sum(local_view(p).numel() * p.element_size() for p in params if id(p) not in padded)
    return sum(padded.values()) + unmanaged, largest


def _activation_estimate(
    context: MeshContext,
    config: PretrainedConfig,
    micro_batch_size: int | None,
    seq_len: int | None,
    dtype: torch.dtype,
    stages: _Stages | None = None,
) -> int | None:
    """Activation bytes kept for backward by one micro batch (:func:`automodel.activation_estimate.activation_bytes`;
    ``docs/plan.md``), in the compute dtype (FSDP2's mixed-precision ``param_dtype``, else the load dtype); under PP,
    over the rank's stages' layers and its microbatches in flight, the logits on the last stage's rank (one
    microbatch's, or every microbatch's under GPipe, which runs all forwards first)."""
    if micro_batch_size is None or seq_len is None:
        return None
    compute = getattr(context.strategy, "param_dtype", None) or dtype
    layers, in_flight, logits_kept = None, 1.0, 1
    if stages is not None:
        layout = context.pipeline
        layers, in_flight = stages.local_layers(context), layout.in_flight()
        last = layout.num_stages - 1 in layout.local_stages
        logits_kept = (layout.microbatches if layout.schedule == "gpipe" else 1) if last else 0
    return activation_bytes(
        config.get_text_config(),
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        tp_size=context.tp_size,
        cp_size=context.cp_size,
        sequence_parallel=context.sequence_parallel,
        activation_checkpointing=context.activation_checkpointing,
        element_size=torch.tensor([], dtype=compute).element_size(),
        layers=layers,
        in_flight=in_flight,
        logits_kept=logits_kept,
    )


def _ranges(members: list[int]) -> str:
    runs, start = [], members[0]
    for previous, current in zip(members, members[1:] + [None], strict=True):
        if current != previous + 1 if current is not None else True:
            runs.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(runs[:8]) + (f" ... ({len(runs)} runs)" if len(runs) > 8 else "")


def _describe_ranks(stands_for: list[int] | str) -> str:
    return stands_for if isinstance(stands_for, str) else _ranges(stands_for)


def _gib(value: int) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB"
