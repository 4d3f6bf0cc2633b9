"""DeepSeek-V4 parallelization policy: the parameters the model keeps in float32 get float32 FSDP units.

transformers keeps DeepSeek-V4's reference-sensitive parameters in float32 whatever the model's dtype
(``_keep_in_fp32_modules_strict``: RMSNorm weights, the mHC mixers ``attn_hc`` / ``ffn_hc`` / ``hc_head``, attention
``sinks`` and the compressors' ``position_bias``). A bfloat16 model therefore mixes dtypes inside every decoder layer,
which one FSDP2 unit refuses, and a bfloat16 ``MixedPrecisionPolicy`` would compute those parameters in bfloat16.
This sidecar's primitive gives them units of their own under a float32 policy, then shards the rest of the unit with
the policy it was given. It serves the MoE path too (the experts hold no float32-kept parameter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

from automodel.distributed import ModelParallelizer, fully_shard_default

__all__ = ["PARALLELIZER"]

# What `_keep_in_fp32_modules_strict` names, told by module class and parameter name rather than by module path,
# because a unit's own path is unknown to `_fully_shard_module` (the model's FSDP plan makes `model.norm` a unit).
# Every weighted RMSNorm, every mHC mixer, the attention sinks and the compressors' position biases; the router's
# `e_score_correction_bias` is a buffer, which FSDP does not shard.
_FP32_MODULES = (DeepseekV4RMSNorm, DeepseekV4HyperConnection, DeepseekV4HyperHead)
_FP32_PARAMETERS = frozenset({"sinks", "position_bias"})
# Inputs are not cast: a float32 unit sits inside a lower-precision layer (a norm, a sink) and must hand back the
# activations' own dtype, exactly as the model does without FSDP.
_FP32_POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


class DeepseekV4Parallelizer(ModelParallelizer):
    """Shards DeepSeek-V4 with dtype-pure FSDP units: float32-kept parameters under a float32 policy."""

    _customizes_moe_fsdp = True

    def _fully_shard_module(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        kept = _fp32_kept_parameters(module)
        if not kept:
            return fully_shard_default(module, **kwargs)
        policies = {False: kwargs, True: {**kwargs, "mp_policy": _FP32_POLICY}}
        # A unit owning float32-kept parameters directly (the final norm, which the model's FSDP plan makes a unit)
        # takes the float32 policy; any other unit (the root included) keeps the policy it was given.
        kind = _direct_kind(module, kept) is True
        _shard_other_kind(module, kept, kind, policies)
        return fully_shard_default(module, **policies[kind])


def _fp32_kept_parameters(module: nn.Module) -> set[int]:
    """Ids of the parameters under ``module`` (not yet in an FSDP unit) that transformers keeps in float32."""
    unsharded = {id(param) for _, param in _unsharded_parameters(module)}
    return {
        id(param)
        for sub in module.modules()
        for name, param in sub.named_parameters(recurse=False)
        if id(param) in unsharded and (isinstance(sub, _FP32_MODULES) or name in _FP32_PARAMETERS)
    }


def _unsharded_parameters(module: nn.Module, recurse: bool = True) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that no FSDP unit (``module`` itself included) manages yet."""
    managed = {id(param) for sub in module.modules() if isinstance(sub, FSDPModule) for param in sub.parameters()}
    return [(name, p) for name, p in module.named_parameters(recurse=recurse) if id(p) not in managed]


def _kinds(module: nn.Module, kept: set[int], recurse: bool = True) -> set[bool]:
    """Which kinds (float32-kept or not) the not-yet-sharded parameters of ``module`` are."""
    return {id(param) in kept for _, param in _unsharded_parameters(module, recurse)}


def _direct_kind(module: nn.Module, kept: set[int]) -> bool | None:
    """Whether the parameters ``module`` owns directly are float32-kept (``None`` when it owns none)."""
    kinds = _kinds(module, kept, recurse=False)
    if len(kinds) > 1:
        names = [name for name, _ in _unsharded_parameters(module, recurse=False)]
        raise ValueError(
            f"{type(module).__name__} owns float32-kept and other parameters directly ({names}), so no FSDP unit "
            "around it can be dtype-uniform."
        )
    return next(iter(kinds), None)


def _shard_other_kind(module: nn.Module, kept: set[int], kind: bool, policies: dict[bool, dict[str, Any]]) -> None:
    """Make every part of ``module`` whose parameters are not of ``kind`` an FSDP unit of its own, innermost first,
    so that what is left for ``module``'s unit is of ``kind`` only.

    A child wholly of the other kind becomes one unit. A child that owns parameters of the other kind directly (the
    attention owns its float32 ``sinks`` beside bfloat16 projections) becomes a unit of the other kind after its own
    parts of ``kind`` are carved out the same way. Other mixed children are searched further down.
    """
    for child in module.children():
        kinds = _kinds(child, kept)
        if kinds <= {kind}:
            continue
        if kinds == {not kind} or _direct_kind(child, kept) is (not kind):
            _shard_other_kind(child, kept, not kind, policies)
            fully_shard_default(child, **policies[not kind])
        else:
            _shard_other_kind(child, kept, kind, policies)


PARALLELIZER = DeepseekV4Parallelizer()
