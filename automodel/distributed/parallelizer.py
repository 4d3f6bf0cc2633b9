"""``ModelParallelizer``: the one model-facing parallelization contract, and the shared default implementation.

``parallelize(model, mesh_context)`` is the only public operation: it plans, then applies. The planner
(:func:`~automodel.distributed.planner.plan_parallelization`) makes every decision and every refusal on the model as
it is, into a frozen :class:`~automodel.distributed.plan.ParallelPlan`; the default ``_apply`` carries the plan out in
one straight pass (:func:`~automodel.distributed.apply.apply_plan`):

    TP (expert rules dropped under EP) -> EP -> CP -> activation checkpointing -> compile -> trainability -> shard

and the resolved context picks what each step does:

==========================  =================================================================================
``ep_size > 1``             the unified MoE path: EP on, shard = FSDP2 (experts over ``ep_shard``, then dense)
FSDP2 without EP            the dense FSDP2 path: shard = FSDP2 units
DDP without EP              the DDP path: shard = torch's composable DDP
Megatron-FSDP without EP    the Megatron-FSDP path: shard = ``megatron_fsdp.fully_shard_model``
==========================  =================================================================================

Sidecars subclass it and override the narrowest protected hook (see ``docs/model-parallelizer.md``); because every
path goes through ``_apply`` and the same plan, an override holds on every path it can apply to, and the planner
refuses up front where one cannot. A sidecar that overrides ``_apply`` itself (to refuse, or to set a model up before
``super()._apply(...)``) is planned inside that call, with the options it passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .apply import apply_plan
from .config import FSDP2Config
from .fsdp import fully_shard_default, shard_default_units
from .mesh import MeshContext
from .parallel_model import adopt_parallelized_class
from .planner import Planned, apply_arguments, check_parallelizer, overrides, path_name, plan_with
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
        ``save_pretrained`` and ``push_to_hub`` are collective and write the consolidated checkpoint; it records
        the plan it was parallelized by as ``model.parallel_plan``.
        """
        arguments = apply_arguments(self, mesh_context)
        planned = None
        if overrides(self, "_apply"):
            # The rest is planned inside the override's super()._apply, with the options it passes.
            notes = check_parallelizer(self, mesh_context)
        else:
            planned = Planned(plan_with(self, model, mesh_context, arguments), arguments)
            notes = list(planned.plan.notes)
        for note in notes:
            log_rank_zero(logger, "%s", note)
        log_rank_zero(
            logger, "Parallelizing %s with %s on %s", type(model).__name__, type(self).__name__, path_name(mesh_context)
        )
        model = self._apply(model, **arguments, parallel_plan=planned)
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
        ``mesh_context`` (EP meshes, strategy), ``save_router_decisions`` and the plan ``parallelize`` made: pass it on
        unchanged. The plan is made again, from the arguments this receives, where an override changed them.
        """
        context = kwargs.get("mesh_context") or MeshContext(device_mesh=device_mesh, strategy=FSDP2Config())
        options = {
            "device_mesh": device_mesh,
            "mp_policy": mp_policy,
            "offload_policy": offload_policy,
            "sequence_parallel": sequence_parallel,
            "activation_checkpointing": activation_checkpointing,
            "tp_shard_plan": tp_shard_plan,
            "dp_replicate_mesh_name": dp_replicate_mesh_name,
            "dp_shard_cp_mesh_name": dp_shard_cp_mesh_name,
            "tp_mesh_name": tp_mesh_name,
            "reshard_after_forward": reshard_after_forward,
            "reapply_trainability": reapply_trainability,
            **{key: value for key, value in kwargs.items() if key != "parallel_plan"},
            "mesh_context": context,
        }
        planned: Planned | None = kwargs.get("parallel_plan")
        if planned is None or not planned.made_from({key: options.get(key) for key in planned.options}):
            # A sidecar's override passed other options (its own TP plan, its own checkpointing): plan with them.
            planned = Planned(plan_with(self, model, context, options), options)
        return apply_plan(self, model, planned.plan, context, options)

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
