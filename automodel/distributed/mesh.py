"""``MeshContext``: the resolved device meshes plus every policy ``ModelParallelizer.parallelize`` reads.

With ``pp_size > 1`` the ranks are first split into ``pp_size`` pipeline stage groups (``pp``, the outermost axis);
the context's meshes are then those of this rank's stage group, and ``MeshContext.pipeline`` holds the ``pp`` mesh
and the schedule (:mod:`pipeline_layout`). The dense mesh has the canonical axes ``("dp_replicate", "dp_shard", "cp", "tp")`` and the flattened axes ``dp``
(``dp_replicate x dp_shard``: ranks that see different batches), ``dp_shard_cp`` (what FSDP shards over) and
``dp_cp`` (what gradients are reduced over). With ``ep_size > 1`` a second mesh ``("ep_shard", "ep")`` over the same
ranks holds the routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from automodel._compat.torch import default_process_group, flatten_mesh

from .config import MoEConfig, StrategyConfig, strategy_from_name
from .layout import Layout, check_layout
from .pipeline_layout import PipelineLayout
from .process_group import ensure_process_group, register_gloo_exit_grace
from .runtime import collective_device

__all__ = [
    "DENSE_AXES",
    "FLATTENED_AXES",
    "MOE_AXES",
    "ActivationCheckpointing",
    "MeshContext",
    "check_layout",
    "forget_meshes",
]

DENSE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"), "dp_cp": DENSE_AXES[:3]}
MOE_AXES = ("ep_shard", "ep")

ActivationCheckpointing = Literal[False, "full", "selective"]


def _normalize_activation_checkpointing(value: bool | str) -> ActivationCheckpointing:
    if value is False or value is None:
        return False
    if value is True or value == "full":
        return "full"
    if value == "selective":
        return "selective"
    raise ValueError(f"activation_checkpointing={value!r} is not a mode: use False, True, 'full' or 'selective'.")


def _check_flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value


def _check_compile(value: bool | str) -> bool | str:
    if value != "auto" and not isinstance(value, bool):
        raise ValueError(f"compile={value!r} must be 'auto', True or False.")
    return value


# Every mesh axis is a process group with its own transport threads, and so is every other group the project
# creates (a pipeline's tied-embedding groups): building the same layout again (a new MeshContext for another model,
# a notebook cell run twice, a second load) reuses them instead of piling up new ones.
_GROUPS: dict[tuple, Any] = {}


def reused_groups(key: tuple, create: Callable[[], Any]) -> Any:
    """``create()`` the first time ``key`` is asked for on the current default process group; its result after.
    Creating a group is collective: every rank asks for the same keys in the same order. The group object itself (not
    its id) is in the key: a destroyed and re-created default group gets new groups."""
    full_key = (default_process_group(), *key)
    if full_key not in _GROUPS:
        _GROUPS[full_key] = create()
    return _GROUPS[full_key]


def _meshes(
    device_type: str, shape: tuple[int, int, int, int], ep_size: int, pp_size: int = 1
) -> tuple[DeviceMesh, dict[str, DeviceMesh], DeviceMesh | None, DeviceMesh | None]:
    """The dense mesh, its flattened axes, the MoE mesh and the ``pp`` mesh. Under PP the dense mesh has the ``pp``
    axis first (``("pp", *DENSE_AXES)``): slicing a dense or flattened axis out of it gives this rank's stage group's
    mesh of that axis, and the flattened axes are registered on it (as the hook signature needs: a root mesh and
    axis names)."""

    def create() -> tuple[DeviceMesh, dict[str, DeviceMesh], DeviceMesh | None, DeviceMesh | None]:
        pp_mesh = None
        if pp_size > 1:
            mesh = init_device_mesh(device_type, (pp_size, *shape), mesh_dim_names=("pp", *DENSE_AXES))
            pp_mesh = mesh["pp"]
        else:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=DENSE_AXES)
        moe_mesh = None
        if ep_size > 1 and pp_size > 1:  # the MoE axes of this rank's stage group, sliced from (pp, ep_shard, ep)
            per_stage = mesh.size() // pp_size
            full = init_device_mesh(
                device_type, (pp_size, per_stage // ep_size, ep_size), mesh_dim_names=("pp", *MOE_AXES)
            )
            moe_mesh = full[MOE_AXES]
        elif ep_size > 1:
            world_size = mesh.size()
            moe_mesh = init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=MOE_AXES)
        return mesh, _flatten_dense_axes(mesh), moe_mesh, pp_mesh

    return reused_groups(("meshes", device_type, shape, ep_size, pp_size), create)


def forget_meshes() -> None:
    """Drop the cached meshes and groups (before destroying the process group they were built on, e.g. a simulated
    rank of ``automodel.plan``)."""
    _GROUPS.clear()


def _flatten_dense_axes(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """Create the flattened axes; torch wants callers to keep the flattened meshes rather than slice them again."""
    return {flat_name: flatten_mesh(mesh[axes], flat_name) for flat_name, axes in FLATTENED_AXES.items()}


@dataclass(frozen=True)
class MeshContext:
    """The sole runtime input of ``ModelParallelizer.parallelize``.

    Holds the resolved meshes (sizes are read from them, never stored twice) and the policy: the strategy config,
    the MoE config, sequence parallelism, the activation-checkpointing mode, the trainability callback that
    re-freezes parameters after activation checkpointing has wrapped modules and before FSDP groups them, and whether
    each decoder block is compiled (``torch.compile``, after TP and activation checkpointing, before sharding;
    ``"auto"``, the default, compiles where the mesh's device is CUDA: see :mod:`automodel.distributed.compile`).

    Build one with :meth:`build` (from sizes, the usual way) or :meth:`from_meshes` (from meshes a caller built).
    """

    device_mesh: DeviceMesh
    strategy: StrategyConfig
    moe_mesh: DeviceMesh | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)
    sequence_parallel: bool = False
    activation_checkpointing: ActivationCheckpointing = False
    reapply_trainability: Callable[[nn.Module], None] | None = None
    compile: bool | str = "auto"
    flattened: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    pipeline: PipelineLayout | None = None

    @classmethod
    def build(
        cls,
        strategy: str | StrategyConfig = "fsdp2",
        *,
        dp_replicate_size: int = 1,
        tp_size: int = 1,
        cp_size: int = 1,
        ep_size: int = 1,
        sequence_parallel: bool = False,
        activation_checkpointing: bool | str = False,
        moe: MoEConfig | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        compile: bool | str = "auto",
        pp_size: int = 1,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_virtual_stages: int = 1,
    ) -> MeshContext:
        """Resolve a layout over all ranks of the default process group (started from torchrun's env if needed).

        ``dp_shard`` is inferred as ``world_size / (pp_size * dp_replicate_size * cp_size * tp_size)``. With
        ``pp_size > 1`` the model is split into pipeline stages (``pp`` is the outermost axis: ``pp_size`` groups of
        consecutive ranks, each running its stages with the other axes), run by ``pp_schedule`` (``gpipe``, ``1f1b``,
        ``interleaved_1f1b`` / ``interleaved_zero_bubble`` with ``pp_virtual_stages >= 2`` stages per rank, ``zbv``
        with two per rank in a V) over ``pp_microbatches`` microbatches
        per step (default ``pp_size``). Every impossible request raises here, identically on every rank, before any
        collective runs.
        """
        strategy = strategy_from_name(strategy)
        mode = _normalize_activation_checkpointing(activation_checkpointing)
        compile = _check_compile(compile)
        ensure_process_group()
        register_gloo_exit_grace()
        layout = Layout(
            strategy,
            dist.get_world_size(),
            pp_size=pp_size,
            dp_replicate_size=dp_replicate_size,
            tp_size=tp_size,
            cp_size=cp_size,
            ep_size=ep_size,
            sequence_parallel=sequence_parallel,
            pp_schedule=pp_schedule,
            pp_microbatches=pp_microbatches,
            pp_virtual_stages=pp_virtual_stages,
        )
        sizes = layout.validate()
        mesh, flattened, moe_mesh, pp_mesh = _meshes(
            collective_device().type, (dp_replicate_size, sizes.dp_shard, cp_size, tp_size), ep_size, pp_size
        )
        pipeline = None
        if pp_mesh is not None:
            pipeline = PipelineLayout(pp_mesh, pp_schedule, sizes.microbatches, pp_virtual_stages)
        return cls(
            device_mesh=mesh,
            strategy=strategy,
            moe_mesh=moe_mesh,
            moe=moe or MoEConfig(),
            sequence_parallel=sequence_parallel,
            activation_checkpointing=mode,
            reapply_trainability=reapply_trainability,
            compile=compile,
            flattened=flattened,
            pipeline=pipeline,
        )

    @classmethod
    def from_meshes(
        cls,
        device_mesh: DeviceMesh,
        *,
        strategy: str | StrategyConfig = "fsdp2",
        moe_mesh: DeviceMesh | None = None,
        moe: MoEConfig | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool | str = False,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        compile: bool | str = "auto",
    ) -> MeshContext:
        """Wrap meshes a caller built. Missing dense axes get size 1; unknown axis names are rejected.

        ``device_mesh`` may name any subset of ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (in that order);
        ``moe_mesh`` must be ``("ep_shard", "ep")``.
        """
        names = tuple(device_mesh.mesh_dim_names or ())
        unknown = [name for name in names if name not in DENSE_AXES]
        if unknown or list(names) != [axis for axis in DENSE_AXES if axis in names]:
            raise ValueError(
                f"device_mesh axes {names} are not canonical: use a subset of {DENSE_AXES} in that order "
                f"(unknown: {unknown or 'none'})."
            )
        if moe_mesh is not None and tuple(moe_mesh.mesh_dim_names or ()) != MOE_AXES:
            raise ValueError(f"moe_mesh axes {moe_mesh.mesh_dim_names} must be exactly {MOE_AXES}.")
        if names != DENSE_AXES:
            device_mesh = _complete_dense_mesh(device_mesh, names)
        register_gloo_exit_grace()
        flattened = _flatten_dense_axes(device_mesh)
        strategy = strategy_from_name(strategy)
        sizes = dict(zip(DENSE_AXES, device_mesh.mesh.shape, strict=True))
        ep_size = moe_mesh.size(1) if moe_mesh is not None else 1
        Layout(
            strategy,
            device_mesh.size(),
            dp_replicate_size=sizes["dp_replicate"],
            tp_size=sizes["tp"],
            cp_size=sizes["cp"],
            ep_size=ep_size,
            sequence_parallel=sequence_parallel,
        ).validate()
        return cls(
            device_mesh=device_mesh,
            strategy=strategy,
            moe_mesh=moe_mesh,
            moe=moe or MoEConfig(),
            sequence_parallel=sequence_parallel,
            activation_checkpointing=_normalize_activation_checkpointing(activation_checkpointing),
            reapply_trainability=reapply_trainability,
            compile=_check_compile(compile),
            flattened=flattened,
        )

    def mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one axis, dense (``dp_replicate`` ... ``dp_cp``) or MoE (``ep_shard``, ``ep``)."""
        if name in MOE_AXES:
            if self.moe_mesh is None:
                raise ValueError(f"Axis {name!r} exists only with ep_size > 1.")
            return self.moe_mesh[name]
        if name in FLATTENED_AXES:
            return (
                self.flattened[name]
                if name in self.flattened
                else flatten_mesh(self.device_mesh[FLATTENED_AXES[name]], name)
            )
        if name not in DENSE_AXES:
            raise ValueError(f"Unknown axis {name!r}: use one of {DENSE_AXES + tuple(FLATTENED_AXES) + MOE_AXES}.")
        return self.device_mesh[name]

    def size(self, name: str) -> int:
        """The number of ranks along one axis (1 for MoE axes without EP)."""
        if name in MOE_AXES and self.moe_mesh is None:
            return 1
        return self.mesh(name).size()

    @property
    def world_size(self) -> int:
        """All ranks of the dense mesh (of one pipeline stage group under PP)."""
        return self.device_mesh.size() // self.pp_size

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel ranks (1 without PP)."""
        return self.pipeline.size if self.pipeline is not None else 1

    @property
    def dp_replicate_size(self) -> int:
        """Replicas of a sharded model (HSDP) or 1."""
        return self.size("dp_replicate")

    @property
    def dp_shard_size(self) -> int:
        """Ranks one replica is sharded over by FSDP (without CP)."""
        return self.size("dp_shard")

    @property
    def dp_size(self) -> int:
        """Ranks that see different batches: ``dp_replicate * dp_shard``."""
        return self.size("dp")

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (the sequence is split over them)."""
        return self.size("cp")

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks."""
        return self.size("tp")

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks (1 without a MoE mesh)."""
        return self.size("ep")

    @property
    def device_type(self) -> str:
        """``"cpu"`` for gloo, ``"cuda"`` for NCCL."""
        return self.device_mesh.device_type


def _complete_dense_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """Rebuild a partial dense mesh with all four canonical axes, missing ones of size 1, over the same ranks."""
    sizes = dict(zip(names, mesh.mesh.shape, strict=True))
    shape = tuple(sizes.get(axis, 1) for axis in DENSE_AXES)
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=DENSE_AXES)
