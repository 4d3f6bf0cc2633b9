"""Model-owned distributed parallelization for Nemotron-H (hybrid Mamba-2 / attention / MLP / MoE blocks).

The policy, step by step: refuse what the model cannot run (context and sequence parallelism) -> activation
checkpointing on the MLP, MoE and Mamba mixers only -> the shared flow (TP with this sidecar's plan, FSDP2) -> one
FSDP unit per decoder block and dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from automodel.distributed import (
    ModelParallelizer,
    checkpoint_module,
    decoder_layers,
    fully_shard_by_dtype,
    shard_default_units,
)

__all__ = ["PARALLELIZER"]

logger = logging.getLogger(__name__)

# Where the decoder blocks live: `backbone.layers` in NVIDIA's original remote-code model, `model.layers` in
# transformers' port, `layers` on the bare backbone.
_BLOCK_CONTAINERS = ("backbone.layers", "model.layers", "layers")
# Mixer types (`config.layers_block_type`) whose activations are recomputed in backward.
_CHECKPOINTED_MIXERS = frozenset({"linear_attention", "mlp", "moe"})
_MODEL_NAME = "Nemotron-H"


def _decoder_blocks(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """Return the mutable decoder container (an ``nn.ModuleList``) and its ordered blocks.

    Works for both checkpoint layouts: ``backbone.layers`` (the original remote-code model) and ``model.layers``
    (transformers).
    """
    for path in _BLOCK_CONTAINERS:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(container, nn.ModuleList):
            return container, list(container)
    raise ValueError(
        f"{type(model).__name__} has no Nemotron-H decoder container (an nn.ModuleList at one of "
        f"{list(_BLOCK_CONTAINERS)}), so its blocks cannot be parallelized."
    )


def _container_name(model: nn.Module, container: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is container)


def _block_type(block: nn.Module) -> str:
    """The block's mixer type; the remote-code blocks record it as ``block_type`` as transformers' do."""
    return getattr(block, "block_type", "")


def _attention_heads_divide(model: nn.Module, tp_size: int) -> bool:
    config = model.config
    return config.num_attention_heads % tp_size == 0 and config.num_key_value_heads % tp_size == 0


def _tp_plan(model: nn.Module, tp_size: int) -> dict[str, str]:
    """The TP plan (transformers style names) for ``model`` over ``tp_size`` ranks.

    transformers' own plan covers only the embeddings and the routed experts. This one adds the MLP and shared-expert
    projections, the output head and, when the heads divide ``tp_size``, the attention projections.

    The Mamba-2 mixers stay replicated (FSDP still shards their storage): `in_proj` packs the gate z, the
    convolution input (x, B, C for n_groups groups) and dt into one output dimension of unequal segments, and the
    depthwise conv1d, the per-head A_log / D / dt_bias, the chunked SSM scan and the group-wise gated norm all have to
    follow one consistent head / group split. No transformers style splits a packed projection by segment and keeps
    the groups aligned, and a plain colwise split would cut across segments and change the model's numerics.
    """
    container, _ = _decoder_blocks(model)
    prefix = _container_name(model, container)
    root = prefix.rpartition(".")[0]
    plan = {
        f"{root}.embeddings" if root else "embeddings": "embedding_rowwise",
        f"{prefix}.*.mixer.up_proj": "colwise",
        f"{prefix}.*.mixer.down_proj": "rowwise",
        f"{prefix}.*.mixer.shared_experts.up_proj": "colwise",
        f"{prefix}.*.mixer.shared_experts.down_proj": "rowwise",
        f"{prefix}.*.mixer.experts.up_proj": "colwise",
        f"{prefix}.*.mixer.experts.down_proj": "rowwise",
        f"{prefix}.*.mixer.experts": "moe_tp_experts",
    }
    if model.get_output_embeddings() is not None:
        plan["lm_head"] = "colwise_gather_output"
    if _attention_heads_divide(model, tp_size):
        plan.update(
            {
                f"{prefix}.*.mixer.q_proj": "colwise",
                f"{prefix}.*.mixer.k_proj": "colwise",
                f"{prefix}.*.mixer.v_proj": "colwise",
                f"{prefix}.*.mixer.o_proj": "rowwise",
            }
        )
    else:
        logger.info(
            "%s: attention heads (%d query, %d key/value) do not divide tp_size=%d; attention stays replicated.",
            _MODEL_NAME,
            model.config.num_attention_heads,
            model.config.num_key_value_heads,
            tp_size,
        )
    return plan


def _refuse_context_parallel(model: nn.Module, cp_size: int) -> None:
    if cp_size > 1:
        raise ValueError(
            f"Context parallelism is not supported for {_MODEL_NAME} ({type(model).__name__}): its Mamba-2 mixers run "
            "a causal convolution and a recurrent SSM scan along the whole sequence, which the all-gather-K/V "
            f"context-parallel attention cannot split over ranks. Use cp_size=1 (got cp_size={cp_size})."
        )


def _refuse_sequence_parallel(model: nn.Module, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ValueError(
            f"Sequence parallelism is not supported for {_MODEL_NAME} ({type(model).__name__}): its Mamba-2 mixers "
            "stay replicated over TP and scan the whole sequence, so they cannot run on sequence shards. Use "
            "sequence_parallel=False."
        )


def _checkpoint_mixers(model: nn.Module, mode: bool | str, replay_routing: bool) -> list[nn.Module]:
    """Checkpoint the Mamba, MLP and MoE mixers; attention is not recomputed.

    The Mamba mixers (the expanded in_proj output, the convolution and the scan states) and the MLPs (an
    intermediate several times the hidden size) hold most of the activation memory, while the fused attention
    kernel keeps little besides its output, and replaying it would cost the most compute.
    """
    if not mode:
        return []
    # The shared traversal's blocks: a pipeline stage's own, not the stand-ins it holds for other stages' blocks
    # (which keep their `block_type` for the model's mask choice, but no mixer).
    mixers = [block.mixer for block in decoder_layers(model) if _block_type(block) in _CHECKPOINTED_MIXERS]
    for mixer in mixers:
        checkpoint_module(mixer, selective=mode == "selective", replay_routing=replay_routing)
    return mixers


class NemotronHModelParallelizer(ModelParallelizer):
    """Apply Nemotron-H's specialized TP, CP, AC, and FSDP policy.

    TP shards the MLP / MoE / output head (and attention when its heads divide), Mamba mixers stay replicated;
    activation checkpointing covers the MLP, MoE and Mamba mixers, not attention; every decoder block is an FSDP
    unit split by dtype (the fp32 MoE router next to bf16 weights); context and sequence parallelism are refused.
    """

    def _apply(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool | str = False,
        tp_shard_plan: dict[str, Any] | str | Callable[[nn.Module], dict[str, str]] | None = None,
        dp_replicate_mesh_name: str = "dp_replicate",
        dp_shard_cp_mesh_name: str = "dp_shard_cp",
        tp_mesh_name: str = "tp",
        reshard_after_forward: bool | None = None,
        reapply_trainability: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Apply every requested parallelism to a Nemotron-H model."""
        _refuse_context_parallel(model, device_mesh["cp"].size())
        _refuse_sequence_parallel(model, sequence_parallel)
        tp_size = device_mesh[tp_mesh_name].size()
        if tp_shard_plan is None and tp_size > 1:
            tp_shard_plan = _tp_plan(model, tp_size)
        # The mixers' forward is wrapped in place; TP's hooks sit on the projections inside them and FSDP's on the
        # blocks around them, so checkpointing them before the shared flow gives the same program as after TP.
        _checkpoint_mixers(model, activation_checkpointing, kwargs.get("save_router_decisions", True))
        return super()._apply(
            model,
            device_mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=False,
            tp_shard_plan=tp_shard_plan,
            dp_replicate_mesh_name=dp_replicate_mesh_name,
            dp_shard_cp_mesh_name=dp_shard_cp_mesh_name,
            tp_mesh_name=tp_mesh_name,
            reshard_after_forward=reshard_after_forward,
            reapply_trainability=reapply_trainability,
            **kwargs,
        )

    def _apply_fsdp_sharding(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | None = None,
    ) -> nn.Module:
        """One FSDP unit per decoder block and dtype, then the embeddings, the head and the root (the shared unit
        boundaries, each split by dtype)."""
        shard = functools.partial(fully_shard_by_dtype, shard=self._fully_shard_module)
        return shard_default_units(
            model,
            shard,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )


PARALLELIZER = NemotronHModelParallelizer()
