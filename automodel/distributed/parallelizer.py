"""``ModelParallelizer``: the one model-facing parallelization contract, and the shared default implementation.

``parallelize(model, mesh_context)`` is the only public operation. It dispatches on the resolved context:

==========================  ====================================================
``ep_size > 1``             unified MoE TP + CP + EP + FSDP path
FSDP2 without EP            dense TP -> activation checkpointing -> FSDP2 (``_apply``)
DDP without EP              shared DDP path
Megatron-FSDP without EP    shared Megatron-FSDP path
==========================  ====================================================

Sidecars subclass it and override the narrowest protected hook (see ``docs/model-parallelizer.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .activation_checkpointing import apply_activation_checkpointing
from .config import DDPConfig, FSDP2Config, MegatronFSDPConfig
from .context_parallel import apply_context_parallel
from .ddp import apply_ddp
from .expert_parallel import apply_expert_parallel, drop_expert_rules, shard_experts, validate_experts
from .fsdp import fsdp_mesh, fully_shard_default, shard_default_units
from .megatron_fsdp import apply_megatron_fsdp, require_megatron_fsdp
from .mesh import MeshContext
from .tensor_parallel import apply_tensor_parallel, resolve_tp_plan, validate_attention_heads

__all__ = ["ModelParallelizer"]

TPShardPlan = dict[str, str | ParallelStyle] | str | Callable[[nn.Module], dict[str, str]]


class ModelParallelizer:
    """Applies the parallelism a ``MeshContext`` asks for to a model, in the shared order.

    A model class opts into custom policy with a ``parallelizer`` attribute holding an instance of a subclass;
    without one the auto classes use ``ModelParallelizer()``.
    """

    #: Set to True when ``_fully_shard_module`` is also required (and safe) on the MoE path, after EP ownership.
    _customizes_moe_fsdp: bool = False
    #: A TP plan (transformers style names) for model classes that ship none; ``None`` uses the model's own.
    _tp_plan: dict[str, str] | None = None

    def parallelize(self, model: nn.Module, mesh_context: MeshContext) -> nn.Module:
        """Parallelize ``model`` in place for ``mesh_context`` and return it.

        The model may be on the meta device (weights are loaded afterwards into the shards) or hold real weights
        (every rank must then hold the same ones).
        """
        if mesh_context.ep_size > 1:
            return _parallelize_moe(self, model, mesh_context)
        strategy = mesh_context.strategy
        if isinstance(strategy, FSDP2Config):
            return self._apply(model, **_dense_apply_arguments(self, mesh_context))
        # DDP and Megatron-FSDP share the dense steps before their own wrapping (DDP has no TP: MeshContext
        # refuses tp_size > 1 with it).
        if isinstance(strategy, (DDPConfig, MegatronFSDPConfig)):
            if isinstance(strategy, MegatronFSDPConfig):
                require_megatron_fsdp()  # fail before touching the model
            _tensor_parallel_step(self, model, mesh_context.mesh("tp"), mesh_context.sequence_parallel, self._tp_plan)
            _activation_checkpointing_step(
                self, model, mesh_context.activation_checkpointing, mesh_context.moe.save_router_decisions
            )
            if mesh_context.reapply_trainability is not None:
                mesh_context.reapply_trainability(model)
            wrap = apply_ddp if isinstance(strategy, DDPConfig) else apply_megatron_fsdp
            return wrap(model, mesh_context)
        raise TypeError(f"Unsupported strategy config {type(strategy).__name__}.")

    # ----------------------------------------------------------------------------------------------------------------
    # Protected hooks: the narrow extension points for model sidecars.
    # ----------------------------------------------------------------------------------------------------------------

    def _apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool | str = False,
        tp_shard_plan: TPShardPlan | None = None,
        dp_replicate_mesh_name: str = "dp_replicate",
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        tp_mesh_name: str = "tp",
        reshard_after_forward: bool | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """The complete dense FSDP2 flow: TP (+SP) -> CP -> activation checkpointing -> trainability -> FSDP units ->
        root.

        Override to surround or replace it for one model, and call ``super()._apply(...)`` to keep the ordering.
        """
        _tensor_parallel_step(self, model, device_mesh[tp_mesh_name], sequence_parallel, tp_shard_plan)
        _context_parallel_step(model, device_mesh["cp"])
        _activation_checkpointing_step(self, model, activation_checkpointing, kwargs.get("save_router_decisions", True))
        if reapply_trainability is not None:
            reapply_trainability(model)
        mesh = fsdp_mesh(device_mesh, dp_replicate_mesh_name, dp_shard_cp_mesh_name)
        if mesh.size() > 1:
            self._apply_fsdp_sharding(
                model,
                mesh=mesh,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                reshard_after_forward=reshard_after_forward,
            )
        return model

    def _apply_fsdp_sharding(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | None = None,
    ) -> nn.Module:
        """Choose the FSDP units and shard each through ``self._fully_shard_module``, then the root.

        Default units: decoder layers (``_no_split_modules``), the model's transformers FSDP plan, and untied input
        embeddings and output head. Override for other boundaries (e.g. dtype-uniform groups).
        """
        return shard_default_units(
            model,
            self._fully_shard_module,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )

    def _fully_shard_module(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        """The FSDP2 primitive for one unit (decoder layers, standalone embeddings, the output head, the root)."""
        return fully_shard_default(module, **kwargs)

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Raise when ``model`` cannot be tensor-parallelized over ``tp_mesh`` (default: attention head counts)."""
        validate_attention_heads(model, tp_mesh.size(), resolve_tp_plan(model))

    def _use_full_layer_activation_checkpointing(self, model: nn.Module) -> bool:
        """Whether activation checkpointing wraps whole decoder layers instead of their attention / MLP blocks."""
        return False


def _tensor_parallel_step(
    parallelizer: ModelParallelizer,
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    tp_shard_plan: TPShardPlan | None,
) -> None:
    if tp_mesh.size() == 1:
        return
    plan = resolve_tp_plan(model, tp_shard_plan if tp_shard_plan is not None else parallelizer._tp_plan)
    # The model records the plan it is sharded with (as transformers' own TP does), so `_validate_tp_mesh` and later
    # readers (checkpoint saving) see the plan actually applied.
    model._tp_plan = plan
    parallelizer._validate_tp_mesh(model, tp_mesh)
    apply_tensor_parallel(model, tp_mesh, plan, sequence_parallel=sequence_parallel)


def _context_parallel_step(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    if cp_mesh.size() > 1:
        apply_context_parallel(model, cp_mesh)


def _activation_checkpointing_step(
    parallelizer: ModelParallelizer, model: nn.Module, mode: bool | str, save_router_decisions: bool = True
) -> None:
    if not mode:
        return
    mode = "full" if mode is True else mode
    apply_activation_checkpointing(
        model,
        mode,
        full_layers=parallelizer._use_full_layer_activation_checkpointing(model),
        replay_routing=save_router_decisions,
    )


def _dense_apply_arguments(parallelizer: ModelParallelizer, context: MeshContext) -> dict[str, Any]:
    """The documented ``_apply`` keyword arguments, derived from the one ``MeshContext``."""
    strategy = context.strategy
    assert isinstance(strategy, FSDP2Config)
    return {
        "device_mesh": context.device_mesh,
        "mp_policy": strategy.mp_policy(),
        "offload_policy": strategy.offload_policy(),
        "sequence_parallel": context.sequence_parallel,
        "activation_checkpointing": context.activation_checkpointing,
        "tp_shard_plan": parallelizer._tp_plan,
        "reshard_after_forward": strategy.reshard_after_forward,
        "reapply_trainability": context.reapply_trainability,
        # Not in the documented signature: reaches `_apply` through **kwargs.
        "save_router_decisions": context.moe.save_router_decisions,
    }


def _parallelize_moe(parallelizer: ModelParallelizer, model: nn.Module, context: MeshContext) -> nn.Module:
    """The unified MoE path: TP on the dense modules -> EP on the routed experts -> CP -> activation checkpointing ->
    trainability -> FSDP (experts over ``ep_shard``, then the dense units over ``dp_shard_cp``) -> root.

    The FSDP primitive is the shared one, or the sidecar's ``_fully_shard_module`` when it sets
    ``_customizes_moe_fsdp`` (it then sees the experts after EP has made them local to their owners).
    """
    strategy = context.strategy
    if not isinstance(strategy, FSDP2Config):
        raise ValueError(
            f"ep_size={context.ep_size} runs on the unified MoE path, which shards with FSDP2: use strategy='fsdp2' "
            f"(got {strategy.name!r})."
        )
    expert_names = validate_experts(model, context.ep_size, context.tp_size)
    if context.tp_size > 1:
        # EP owns the experts: the TP plan's expert rules (moe_tp_experts, packed_colwise ...) are dropped.
        plan = drop_expert_rules(resolve_tp_plan(model, parallelizer._tp_plan), expert_names)
        _tensor_parallel_step(parallelizer, model, context.mesh("tp"), context.sequence_parallel, plan)
    experts = apply_expert_parallel(model, context.mesh("ep"), context.mesh("tp"))
    _context_parallel_step(model, context.mesh("cp"))
    _activation_checkpointing_step(
        parallelizer, model, context.activation_checkpointing, context.moe.save_router_decisions
    )
    if context.reapply_trainability is not None:
        context.reapply_trainability(model)
    shard = parallelizer._fully_shard_module if parallelizer._customizes_moe_fsdp else fully_shard_default
    options = {"mp_policy": strategy.mp_policy(), "offload_policy": strategy.offload_policy()}
    shard_experts(
        experts,
        shard,
        mesh=context.mesh("ep_shard"),
        batches_per_step=context.world_size // context.tp_size,
        reshard_after_forward=strategy.reshard_after_forward,
        **options,
    )
    mesh = fsdp_mesh(context.device_mesh, "dp_replicate", "dp_shard_cp")
    if mesh.size() > 1:
        shard_default_units(model, shard, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward, **options)
    return model
