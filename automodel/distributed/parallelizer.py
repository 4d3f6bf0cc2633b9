"""``ModelParallelizer``: the one model-facing parallelization contract, and the shared default implementation.

``parallelize(model, mesh_context)`` is the only public operation. Every path runs one flow, written once in
``_apply`` (the steps are the functions of ``checklist.py``):

    TP (expert rules dropped under EP) -> EP -> CP -> activation checkpointing -> compile -> trainability -> shard

and the resolved context picks what each step does:

==========================  =================================================================================
``ep_size > 1``             the unified MoE path: EP on, shard = FSDP2 (experts over ``ep_shard``, then dense)
FSDP2 without EP            the dense FSDP2 path: shard = FSDP2 units
DDP without EP              the DDP path: shard = torch's composable DDP
Megatron-FSDP without EP    the Megatron-FSDP path: shard = ``megatron_fsdp.fully_shard_model``
==========================  =================================================================================

Sidecars subclass it and override the narrowest protected hook (see ``docs/model-parallelizer.md``); because every
path goes through ``_apply`` and the same steps, an override holds on every path it can apply to, and
``hook_policy.check_hooks`` refuses up front where one cannot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from . import checklist
from .config import FSDP2Config, MegatronFSDPConfig
from .fsdp import fsdp_mesh, fully_shard_default, shard_default_units
from .hook_policy import check_hooks, path_name
from .megatron_fsdp import require_megatron_fsdp
from .mesh import MeshContext
from .parallel_model import adopt_parallelized_class
from .runtime import log_rank_zero
from .tensor_parallel import resolve_tp_plan, validate_attention_heads

__all__ = ["ModelParallelizer", "parallelizer_for"]

logger = logging.getLogger(__name__)

TPShardPlan = dict[str, str | ParallelStyle] | str | Callable[[nn.Module], dict[str, str]]


class ModelParallelizer:
    """Applies the parallelism a ``MeshContext`` asks for to a model, in the shared order.

    A model class opts into custom policy with a ``parallelizer`` attribute holding an instance of a subclass;
    without one the auto classes use ``ModelParallelizer()``.
    """

    #: Set to True when ``_fully_shard_module`` is also required (and safe) on the MoE path, after EP ownership.
    _customizes_moe_fsdp: bool = False
    #: A TP plan (transformers style names) where the model class ships none or an unusable one: a dict, or a function
    #: of the model returning one (``staticmethod``); ``None`` uses the model's own.
    _tp_plan: TPShardPlan | None = None

    def parallelize(self, model: nn.Module, mesh_context: MeshContext) -> nn.Module:
        """Parallelize ``model`` in place for ``mesh_context`` and return it.

        The model may be on the meta device (weights are loaded afterwards into the shards) or hold real weights
        (every rank must then hold the same ones). Every request that cannot be honoured raises before the model is
        touched, identically on every rank. A transformers model keeps its class, as a subclass whose
        ``save_pretrained`` and ``push_to_hub`` are collective and write the consolidated checkpoint.
        """
        check_hooks(self, mesh_context)
        _check_strategy(mesh_context)
        log_rank_zero(
            logger, "Parallelizing %s with %s on %s", type(model).__name__, type(self).__name__, path_name(mesh_context)
        )
        model = self._apply(model, **_apply_arguments(self, mesh_context))
        adopt_parallelized_class(model)
        return model

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
        """The whole flow, on every path: TP (+SP; expert rules dropped under EP) -> EP -> CP -> activation
        checkpointing -> compile (``mesh_context.compile``) -> trainability -> shard (FSDP2 units, DDP or
        Megatron-FSDP).

        Override to surround or replace it for one model, and call ``super()._apply(...)`` to keep the ordering; the
        override runs on every path, so refusals and policies it adds hold everywhere. ``kwargs`` carries the
        ``mesh_context`` (EP meshes, strategy) and ``save_router_decisions``: pass it on unchanged.
        """
        context = kwargs.get("mesh_context") or MeshContext(device_mesh=device_mesh, strategy=FSDP2Config())
        tp_mesh = device_mesh[tp_mesh_name]
        # Everything that can refuse runs first, so a refusal leaves the model untouched.
        checklist.validate_encoder_towers(model, device_mesh["cp"].size())
        expert_names = checklist.validate_expert_parallel(model, context)
        compiling = checklist.validate_compile(context)
        tp_plan = checklist.plan_tensor_parallel(self, model, tp_mesh, tp_shard_plan, expert_names)
        requires_grad = {name: param.requires_grad for name, param in model.named_parameters()}

        done = [checklist.tensor_parallel_step(model, tp_mesh, tp_plan, sequence_parallel, expert_names)]
        experts = checklist.expert_parallel_step(model, context, expert_names)
        if experts:
            done.append(f"EP over ep={context.ep_size}: {sum(map(len, experts))} experts modules")
        done.append(checklist.context_parallel_step(model, device_mesh["cp"]))
        replay_routing = kwargs.get("save_router_decisions", context.moe.save_router_decisions)
        done.append(checklist.activation_checkpointing_step(self, model, activation_checkpointing, replay_routing))
        done.append(checklist.compile_step(model, compiling))
        done.append(checklist.trainability_step(model, requires_grad, reapply_trainability))
        model, sharded = checklist.shard_step(
            self,
            model,
            context,
            experts,
            fsdp_mesh(device_mesh, dp_replicate_mesh_name, dp_shard_cp_mesh_name),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )
        done.append(sharded)
        for line in filter(None, done):
            log_rank_zero(logger, "%s", line)
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
        """Choose the dense FSDP units and shard each through ``self._fully_shard_module``, then the root.

        Default units: decoder layers (``_no_split_modules``, else the model's repeated blocks), the model's
        transformers FSDP plan, and untied input embeddings and output head. On the MoE path the experts are units
        already. Override for other boundaries (e.g. dtype-uniform groups).
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
        """The FSDP2 primitive for one unit (decoder layers, standalone embeddings, the output head, the root; the
        experts too on the MoE path when ``_customizes_moe_fsdp`` is set)."""
        return fully_shard_default(module, **kwargs)

    def _validate_tp_mesh(self, model: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Raise when ``model`` cannot be tensor-parallelized over ``tp_mesh`` (default: attention head counts of the
        plan being applied, which ``model._tp_plan`` holds when this runs)."""
        validate_attention_heads(model, tp_mesh.size(), resolve_tp_plan(model))

    def _use_full_layer_activation_checkpointing(self, model: nn.Module) -> bool:
        """Whether activation checkpointing wraps whole decoder layers instead of their attention / MLP blocks."""
        return False


def parallelizer_for(model: nn.Module) -> ModelParallelizer:
    """The parallelizer a model's class carries (its sidecar's ``PARALLELIZER``), else ``ModelParallelizer()``."""
    return getattr(type(model), "parallelizer", None) or ModelParallelizer()


def _check_strategy(context: MeshContext) -> None:
    """Refuse what no path can run, before the model is touched (``MeshContext.build`` refuses these too; a context
    built field by field reaches here)."""
    strategy = context.strategy
    if context.ep_size > 1 and not isinstance(strategy, FSDP2Config):
        raise ValueError(
            f"ep_size={context.ep_size} runs on the unified MoE path, which shards with FSDP2: use strategy='fsdp2' "
            f"(got {strategy.name!r})."
        )
    if isinstance(strategy, MegatronFSDPConfig):
        require_megatron_fsdp()
        if context.cp_size > 1:
            raise ValueError(
                f"strategy='megatron_fsdp' with cp_size={context.cp_size} is not supported: use strategy='fsdp2' "
                "for context parallelism."
            )


def _apply_arguments(parallelizer: ModelParallelizer, context: MeshContext) -> dict[str, Any]:
    """The documented ``_apply`` keyword arguments, derived from the one ``MeshContext``; the context itself and the
    router policy travel in ``**kwargs``."""
    strategy = context.strategy
    fsdp2 = isinstance(strategy, FSDP2Config)
    return {
        "device_mesh": context.device_mesh,
        "mp_policy": strategy.mp_policy() if fsdp2 else None,
        "offload_policy": strategy.offload_policy() if fsdp2 else None,
        "sequence_parallel": context.sequence_parallel,
        "activation_checkpointing": context.activation_checkpointing,
        "tp_shard_plan": parallelizer._tp_plan,
        "reshard_after_forward": strategy.reshard_after_forward if fsdp2 else None,
        "reapply_trainability": context.reapply_trainability,
        "mesh_context": context,
        "save_router_decisions": context.moe.save_router_decisions,
    }
