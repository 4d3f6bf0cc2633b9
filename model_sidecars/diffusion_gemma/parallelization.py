"""DiffusionGemma parallelization policy: each layer's routed experts are an FSDP unit of their own, before the layer.

``DiffusionGemmaForBlockDiffusion`` is an encoder-decoder whose decoder layer ``i`` holds exactly the parameters of
encoder layer ``i`` (tied by transformers), as the decoder token embeddings and ``lm_head`` hold the encoder's. The
shared traversal keeps every module holding a tied parameter in the root unit, so by default the whole model is one
FSDP unit. This sidecar makes each pair of twin layers one unit (FSDP2 shards a parameter in one unit only, whose
hooks must cover every module using it), with the pair's experts as a unit of their own before it; the tied
embeddings, the vision tower, the norms and the self-conditioning block stay in the root.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from automodel.distributed import ModelParallelizer, decoder_layers, tied_module_groups

from .fsdp import Modules, _fully_shard_experts_first

__all__ = ["PARALLELIZER"]


_LAYER_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.q_norm": "replicated_with_grad_allreduce",
    "self_attn.k_norm": "replicated_with_grad_allreduce",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "experts.gate_up_proj": "packed_colwise",
    "experts.down_proj": "rowwise",
    "experts": "moe_tp_experts",
}


class DiffusionGemmaParallelizer(ModelParallelizer):
    """Shards DiffusionGemma with one unit per pair of tied encoder / decoder layers, and their experts before it."""

    # The primitive is needed on the MoE path too (twin layers are one unit) and safe there: it leaves the experts,
    # which EP has made units over ep_shard, as they are.
    _customizes_moe_fsdp = True

    # transformers' plan shards the encoder's layers and embeddings only; the decoder's twins hold the same
    # parameters, so they must get the same placements (the shared TP step refuses tied parameters placed apart).
    _tp_plan = {
        "lm_head": "colwise_gather_output",
        "model.encoder.language_model.embed_tokens": "embedding_rowwise",
        "model.decoder.embed_tokens": "embedding_rowwise",
        **{f"model.encoder.language_model.layers.*.{name}": style for name, style in _LAYER_TP_PLAN.items()},
        **{f"model.decoder.layers.*.{name}": style for name, style in _LAYER_TP_PLAN.items()},
    }

    def _apply_fsdp_sharding(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | None = None,
    ) -> nn.Module:
        options = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload_policy}
        for twins in tied_module_groups(decoder_layers(model)):
            self._fully_shard_module(twins, reshard_after_forward=reshard_after_forward, **options)
        # The root holds the tied embeddings / lm_head, used again right after forward for backward.
        return self._fully_shard_module(model, reshard_after_forward=False, **options)

    def _fully_shard_module(self, module: Modules, **kwargs: Any) -> Modules:
        return _fully_shard_experts_first(module, **kwargs)


PARALLELIZER = DiffusionGemmaParallelizer()
