"""Every private torch symbol automodel uses, imported once (see :mod:`automodel._compat`).

"Known" gives the releases a symbol was checked in: from the oldest release checked (2.9.0) or the one it appeared
in, to the newest tested one. The tested range is ``TESTED_RANGES["torch"]`` (2.11.0 to 2.14.1).

Not wrapped, on purpose: ``nn.Module``'s own storage (``_parameters``, ``_buffers``, ``_non_persistent_buffers_set``),
which the loader and the TP styles read and assign directly, as torch's own ``nn.Module`` methods and most of the
ecosystem do; it has not changed since torch 1.0.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .versions import MissingSymbolError, private_symbol

__all__ = [
    "SDPA_KERNEL_OPS",
    "FakeStore",
    "StridedShard",
    "TorchDispatchMode",
    "TorchDynamoException",
    "all_gather",
    "all_gather_autograd",
    "apply_to_tensors",
    "default_process_group",
    "dtensor_like",
    "flatten_mesh",
    "fsdp_param_groups",
    "fsdp_sizes",
    "fsdp_state",
    "full_tensor",
    "is_to_local_view",
    "mutated_tensors",
    "on_worker_failure",
    "pipeline_stage",
    "replicate",
    "set_last_lr",
    "shared_mesh_concatenations",
    "shard_chunks_on_demand",
    "at_end_of_backward",
    "distribution_checks_off",
    "split_placement",
    "tree_leaves",
    "tree_map_only",
]


def _torch(*paths: str, purpose: str) -> Any:
    return private_symbol("torch", *paths, purpose=purpose)


# Subclassed by activation checkpointing to record and replay MoE routing decisions (top-k saved, not recomputed), and
# by the loader's init to see which tensors a model's `_init_weights` wrote. Known: 2.9.0 - 2.14.1.
TorchDispatchMode = _torch(
    "torch.utils._python_dispatch.TorchDispatchMode", purpose="recording MoE routing and the writes of an init"
)
# Map / flatten the tensors in nested module inputs and outputs (tuples, dicts, ModelOutput): TP output hooks, routing
# records, partial gradients. Known: 2.9.0 - 2.14.1.
tree_map_only = _torch("torch.utils._pytree.tree_map_only", purpose="mapping the tensors of nested module outputs")
tree_leaves = _torch("torch.utils._pytree.tree_leaves", purpose="finding the tensors of nested module inputs")

# The functional all-gather along one dimension, plain and autograd-aware (context parallelism gathers keys, values
# and positions). Shim: torch 2.13 renamed all_gather_tensor(_autograd) to all_gather_single(_autograd), and the old
# names warn there, so the new name is used where it exists. Known: all_gather_tensor(_autograd) 2.9.0 - 2.14.1,
# all_gather_single(_autograd) 2.13.0 - 2.14.1.
all_gather = _torch(
    "torch.distributed._functional_collectives.all_gather_single",
    "torch.distributed._functional_collectives.all_gather_tensor",
    purpose="the context-parallel all-gather",
)
all_gather_autograd = _torch(
    "torch.distributed._functional_collectives.all_gather_single_autograd",
    "torch.distributed._functional_collectives.all_gather_tensor_autograd",
    purpose="the autograd-aware context-parallel all-gather of keys and values",
)

# Composable DDP: keeps the model's own class (generate, save_pretrained) where DistributedDataParallel would wrap it.
# Known: 2.9.0 - 2.14.1.
replicate = _torch("torch.distributed._composable.replicate.replicate", purpose="the DDP strategy")

# The store of torch's fake process group (backend "fake": collectives return at once, no peer exists): one process
# acts as any rank of any world size, to plan and measure a layout at scale. Known: 2.9.0 - 2.14.1.
FakeStore = _torch(
    "torch.testing._internal.distributed.fake_pg.FakeStore", purpose="simulating a rank of any world size"
)

# The base of the errors torch.compile raises while dynamo traces a frame or the backend compiles it (inductor's
# included): a compiled decoder block falls back to its eager forward on them. Known: 2.9.0 - 2.14.1.
TorchDynamoException = _torch(
    "torch._dynamo.exc.TorchDynamoException", purpose="running a block eagerly when its compilation fails"
)

# The interleaved placement FSDP2 gives a dimension that TP already shards; the loader computes each rank's slice of
# it. Known: 2.9.0 - 2.14.1 (``is_shard()`` is False for it in 2.13, so callers test the type).
StridedShard = _torch(
    "torch.distributed.tensor.placement_types._StridedShard", purpose="reading FSDP2 x TP shards of a checkpoint"
)

# The layout of a DTensor (mesh, placements, global shape), from which a gather is planned; ``full_tensor`` reads
# ``use_strided_shard_as_shard_order`` and ``_maybe_convert_StridedShard_to_shard_order`` on it. Known: 2.11.0 -
# 2.14.1 (the releases checked). ``_StridedShardNotDecodableError`` beside it marks the releases whose gathers fall
# back to the greedy planner for a ``_StridedShard`` that encodes no shard order. Known: 2.12.1 - 2.14.1.
DTensorSpec = _torch("torch.distributed.tensor._dtensor_spec.DTensorSpec", purpose="gathering TP's packed weights")
_GATHERS_ANY_STRIDED_SHARD = hasattr(sys.modules[DTensorSpec.__module__], "_StridedShardNotDecodableError")


# The private ATen overloads scaled_dot_product_attention dispatches to; selective activation checkpointing saves
# their outputs instead of recomputing attention. Known: 2.9.0 - 2.14.1.
def _aten_overload(name: str) -> Any:
    try:
        return getattr(torch.ops.aten, name).default
    except AttributeError:
        raise MissingSymbolError(
            "torch", f"torch.ops.aten.{name}", "saving attention outputs under selective activation checkpointing"
        ) from None


SDPA_KERNEL_OPS: tuple[Any, ...] = tuple(
    _aten_overload(name)
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
)

# The default process group object; meshes are cached per group, so a re-created group gets new meshes.
# Known: 2.9.0 - 2.14.1.
_get_default_group = _torch(
    "torch.distributed.distributed_c10d._get_default_group", purpose="caching device meshes per process group"
)


def default_process_group() -> Any:
    """The initialised default process group (``torch.distributed.distributed_c10d._get_default_group``)."""
    return _get_default_group()


# The autograd node DTensor.to_local() leaves on its output; TP styles hand such views back as owned tensors.
# Known: 2.9.0 - 2.14.1.
_TO_LOCAL_NODE = "_ToTorchTensorBackward"


def is_to_local_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the view ``DTensor.to_local()`` returned (``Tensor._is_view`` and its autograd node)."""
    return tensor._is_view() and type(tensor.grad_fn).__name__ == _TO_LOCAL_NODE


def mutated_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an ATen ``op`` writes (in-place ``self``, ``out=``), from its schema's alias annotations
    (``OpOverload._schema``): how a dispatch mode tells which tensors an init wrote. Known: 2.9.0 - 2.14.1."""
    written = []
    for position, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(item for item in value if isinstance(item, torch.Tensor))
    return written


def fsdp_param_groups(unit: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of a ``fully_shard`` unit, whose ``is_unsharded`` tells whether the unit's
    parameters are gathered (empty for a unit without parameters).

    Shim: torch 2.12 made the one optional group of a unit (``FSDPState._fsdp_param_group``, known up to 2.11.0) a
    list (``FSDPState._fsdp_param_groups``, known 2.12.0 - 2.14.1, one group per mesh a ``shard_placement_fn`` picks),
    and kept the old name as a property that refuses a unit with more than one group, so the list is read where it
    exists."""
    state = fsdp_state(unit)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def pipeline_stage(module: nn.Module, stage_index: int, num_stages: int, device: torch.device, *, group: Any) -> Any:
    """torch's ``PipelineStage`` running ``module`` as stage ``stage_index`` of ``num_stages`` over ``group``.

    Shim: before its first step a schedule warms up the P2P links between neighbouring stages. Up to torch 2.11 every
    stage exchanges a message with both neighbours (``_get_init_p2p_neighbors_ops``, known 2.11.0 - 2.12.1), the one
    on its own rank included, where a V-shaped schedule (``zbv``) places two adjacent stages; gloo cannot send to its
    own rank ("Pair is not connected"). torch 2.12 replaced that warm-up by a vote that passes same-rank neighbours
    their value directly (``PipelineStage._warmup_forward_vote``, known 2.12.1 - 2.14.1). Where the vote is missing,
    the stage leaves its own rank out of the warm-up messages (a run between same-rank stages sends nothing in any
    release)."""
    return _pipeline_stage_class()(module, stage_index, num_stages, device, group=group)


@functools.cache
def _pipeline_stage_class() -> type:
    from torch.distributed import P2POp, get_rank
    from torch.distributed.pipelining import PipelineStage

    if hasattr(PipelineStage, "_warmup_forward_vote"):
        return PipelineStage

    class PipelineStageWarmingUpNeighboursOnly(PipelineStage):
        """``PipelineStage`` whose P2P warm-up leaves out the messages to its own rank (torch 2.11)."""

        def _get_init_p2p_neighbors_ops(self) -> list[P2POp]:
            own_rank = get_rank()
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.peer != own_rank]

    return PipelineStageWarmingUpNeighboursOnly


def fsdp_sizes(model: nn.Module) -> tuple[dict[int, int], int]:
    """What FSDP2 allocates in ``model`` (sharded, possibly on meta): the padded shard bytes of each parameter it
    manages (by ``id`` of the sharded parameter) and the largest parameter group's all-gather output in bytes, in
    the group's mixed-precision ``param_dtype`` where one is set (``FSDPParamGroup.fsdp_params`` / ``.mp_policy``,
    ``FSDPParam.padded_sharded_param_size`` / ``.mesh_info``). Known: 2.11.0 - 2.14.1 (the releases checked)."""
    from torch.distributed.fsdp import FSDPModule

    padded: dict[int, int] = {}
    largest = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            param_dtype = getattr(group.mp_policy, "param_dtype", None)
            gather = 0
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                elements = fsdp_param.padded_sharded_param_size.numel()
                padded[id(param)] = elements * param.element_size()
                size = torch.empty(0, dtype=param_dtype or param.dtype).element_size()
                gather += elements * fsdp_param.mesh_info.shard_mesh_size * size
            largest = max(largest, gather)
    return padded, largest


def full_tensor(tensor: DTensor) -> torch.Tensor:
    """The whole value of ``tensor`` on every rank of its mesh (collective): ``DTensor.full_tensor()``.

    Shim: a ``_StridedShard`` that is not FSDP2's encoding of the order TP and FSDP2 shard a dim in (TP's packed
    ``gate_up_proj``: split factor 2 on the TP mesh, alone or beside a ``Shard`` of the experts) cannot be gathered up
    to torch 2.11, whose graph-based planner reads every ``_StridedShard`` as such an order and raises "unable to be
    interpreted into a corresponding shard_order"; torch 2.12 falls back to its greedy planner there. Up to 2.11 such a
    tensor is gathered under a spec that reads the ``_StridedShard`` as the interleaved placement it is
    (``use_strided_shard_as_shard_order=False``); the result has no autograd graph then (what is gathered whole is a
    weight or a gradient being read)."""
    spec = tensor._spec
    if _GATHERS_ANY_STRIDED_SHARD or not any(isinstance(p, StridedShard) for p in spec.placements):
        return tensor.full_tensor()
    if DTensorSpec._maybe_convert_StridedShard_to_shard_order(spec.placements, spec.mesh) is not None:
        return tensor.full_tensor()
    readable = DTensorSpec(
        spec.mesh, spec.placements, tensor_meta=spec.tensor_meta, use_strided_shard_as_shard_order=False
    )
    with torch.no_grad():
        return DTensor(tensor._local_tensor, readable, requires_grad=False).full_tensor()


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A ``DTensor`` with the spec of ``like`` (mesh, placements, global shape, stride and dtype) holding ``local`` as
    its local shard, with no autograd history: DTensor's constructor, as FSDP2 builds its sharded parameters.
    ``DTensor.from_local`` builds the same spec anew through an autograd function (30 us against 4 us a tensor, paid
    for every parameter of every load). Known: 2.11.0 - 2.14.1 (the releases checked)."""
    return DTensor(local, like._spec, requires_grad=False)


def fsdp_state(unit: nn.Module) -> Any:
    """The FSDP2 state object of a ``fully_shard`` unit (``FSDPModule._get_fsdp_state()``), one per unit (grouped
    modules share it). Known: 2.9.0 - 2.14.1."""
    return unit._get_fsdp_state()


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dims of ``mesh`` (a slice of the dense mesh) as one 1-D mesh named ``name``, the axes FSDP2 and the loss
    reductions run over (``DeviceMesh._flatten``). Known: 2.11.0 - 2.14.1 (the releases checked)."""
    return mesh._flatten(mesh_dim_name=name)


_CONCATENATE = DeviceMesh.__dict__.get("_concatenate")
if not isinstance(_CONCATENATE, staticmethod):
    raise MissingSymbolError(
        "torch", "torch.distributed.device_mesh.DeviceMesh._concatenate", "sharing FSDP2's (DP, TP) meshes"
    )


@contextlib.contextmanager
def shared_mesh_concatenations() -> Iterator[None]:
    """While inside, ``DeviceMesh._concatenate`` gives the same mesh object for the same meshes.

    FSDP2 concatenates its DP mesh with the mesh of every parameter that TP or EP already shards, once per parameter
    (``FSDPParam._init_sharding_spec_tp``, and ``_init_sharding_spec_spmd`` where it exists): 723 equal meshes for a 70B
    Llama under FSDP2 x TP=8, about half of the rank's ``fully_shard`` time (0.31-0.38 s against 0.16-0.20 s CPU with
    one mesh per pair). A mesh is not changed once built, so the parameters can share it, as they share the DP and TP
    meshes themselves. Each answer is keyed by the identities of the meshes given, which are kept alive until the
    block ends. Known: 2.11.0 - 2.14.1 (the releases checked)."""
    build, outer = _CONCATENATE.__func__, DeviceMesh.__dict__["_concatenate"]
    built: dict[tuple[int, ...], tuple[DeviceMesh, list[DeviceMesh]]] = {}

    def concatenate(device_mesh_list: list[DeviceMesh]) -> DeviceMesh:
        key = tuple(map(id, device_mesh_list))
        if key not in built:
            built[key] = (build(device_mesh_list), list(device_mesh_list))
        return built[key][0]

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = outer


# FSDP2's split of a parameter into its ranks' chunks, padded with empty tensors to one per rank (called only while an
# FSDPParam is set up, which indexes the list). Resolved here so that a release without the name fails at import
# instead of the shim below setting an attribute nothing reads. Known: 2.11.0 - 2.14.1 (the releases checked).
_fsdp_param_module = _torch(
    "torch.distributed.fsdp._fully_shard._fsdp_param", purpose="splitting FSDP2's parameters by rank"
)
_chunk_with_empty = _torch(
    "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty", purpose="splitting FSDP2's parameters by rank"
)


class _ChunksOnDemand(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, num_chunks, dim)`` padded with empty tensors to ``num_chunks`` (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is asked for."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._num_chunks, self._dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self._step = -(-size // num_chunks)  # torch.chunk's chunk size (rounded up)
        # How many chunks torch.chunk returns: fewer than asked when the size does not fill them; a zero-size dim
        # gives num_chunks empty ones.
        self._chunks = -(-size // self._step) if size else num_chunks

    def __len__(self) -> int:
        return self._num_chunks

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        if not -self._num_chunks <= index < self._num_chunks:
            raise IndexError(f"chunk {index} of {self._num_chunks}")
        index %= self._num_chunks
        if index >= self._chunks:
            return self[0].new_empty(0)
        start = index * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, self._tensor.size(self._dim) - start))


@contextlib.contextmanager
def shard_chunks_on_demand() -> Iterator[None]:
    """While inside, FSDP2 splits a parameter into the chunks it asks for only, not one per rank.

    ``fully_shard`` splits every parameter into one chunk per rank of its mesh and pads the list with empty tensors to
    that length, then takes its own rank's chunk and the first. At 1,024 ranks that is a thousand tensors made per
    parameter: 3.6 s of a rank's 4.0 s of ``fully_shard`` for Qwen3-235B under EP=64 (1,037 parameters), growing with
    the world size. Here each chunk is the same view (``narrow``) or the same empty tensor, made when indexed.
    Known: 2.11.0 - 2.14.1 (the releases checked)."""
    outer = _fsdp_param_module._chunk_with_empty
    _fsdp_param_module._chunk_with_empty = _ChunksOnDemand
    try:
        yield
    finally:
        _fsdp_param_module._chunk_with_empty = outer


def apply_to_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *, recurse: bool = True) -> None:
    """Replace every parameter's and buffer's data by ``fn(tensor)`` as ``Module.to_empty`` does (``nn.Module._apply``,
    the conversion ``to``, ``to_empty`` and FSDP2's re-padding of its shards go through), with a function of our own.
    Known: 2.9.0 - 2.14.1."""
    module._apply(fn, recurse=recurse)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (called from inside it: a tensor's gradient hook); a
    callback queued by a callback runs after every callback already queued, FSDP2's final one included
    (``Variable._execution_engine.queue_callback``, what FSDP2 itself uses). Known: 2.9.0 - 2.14.1."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@contextlib.contextmanager
def distribution_checks_off() -> Iterator[None]:
    """``torch.distributions`` without their argument checks, which read values (a meta-device trace has none); the
    previous default (``Distribution._validate_args``) is restored after. Known: 2.9.0 - 2.14.1."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)


def split_placement(placement: Placement, tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """The pieces a ``Shard`` or ``_StridedShard`` placement on dim 0 cuts ``tensor`` into over ``num_chunks`` ranks,
    uneven ones unpadded, by DTensor's own split rule (``Shard._split_tensor``): the oracle the loader's closed-form
    per-rank chunks (``automodel.loading.placements.local_runs``) are tested against. Known: 2.11.0 - 2.14.1 (the
    releases checked)."""
    pieces, _ = placement._split_tensor(tensor, num_chunks, with_padding=False)
    return pieces


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``lrs`` after the learning rates were set directly (a resumed run
    on a new schedule); torch has no public setter (``LRScheduler._last_lr``). Known: 2.11.0 - 2.14.1 (the releases
    checked)."""
    scheduler._last_lr = lrs


# torchrun's record of a failed worker: when it finds a worker process ended with a non-zero status, its
# ``SubprocessContext`` logs ``"failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"`` at ERROR on this
# logger, with the exit status (minus the signal number for a signal), the local rank and the process id as the
# record's first three arguments; it is the only place torchrun says how a worker ended before it restarts the
# group. Known: 2.11.0 - 2.14.1 (the releases checked).
_WORKER_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_WORKER_FAILURE_MESSAGE = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def on_worker_failure(callback: Callable[[int, int, int], None]) -> None:
    """Call ``callback(exitcode, local_rank, pid)`` in this torchrun process each time it finds a failed worker (the
    first of a group's failures: the one that made it stop the others). A record of another form is ignored."""
    import logging

    class _WorkerFailures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == _WORKER_FAILURE_MESSAGE and isinstance(record.args, tuple) and len(record.args) >= 3:
                exitcode, local_rank, pid = record.args[:3]
                callback(int(exitcode), int(local_rank), int(pid))

    logging.getLogger(_WORKER_FAILURE_LOGGER).addHandler(_WorkerFailures(logging.ERROR))


# torch.distributed.pipelining's zero-bubble weight pass (``stage_backward_weight``) runs a custom autograd.Function's
# backward a second time only from 2.13: 2.11 fails in ``_make_grads`` on the function's node ("Attribute
# '_input_metadata' is invalid for this instance of _C._FunctionBase"; the fused loss is one). Checked: 2.11.0 fails,
# 2.13.0 and 2.14.1 run; 2.12 not checked, so not assumed.
ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
