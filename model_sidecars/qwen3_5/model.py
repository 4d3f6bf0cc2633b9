"""The Qwen3.5 text causal LM as the registry loads it: GatedDeltaNet's decay and norm parameters kept in fp32."""

from __future__ import annotations

import re

import torch
import transformers

from .parallelization import PARALLELIZER

__all__ = ["Qwen3_5ForCausalLM"]

# GatedDeltaNet's decay parameters (A_log, and dt_bias, which the same module owns and which enters the same fp32
# decay computation) and its gated RMSNorm weight. A_log and dt_bias must share one dtype: a module's direct
# parameters always land in one FSDP unit.
_KEEP_IN_FP32 = ("A_log", "dt_bias", "linear_attn.norm")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Qwen3_5ForCausalLM(transformers.Qwen3_5ForCausalLM):
    """transformers' ``Qwen3_5ForCausalLM`` with GatedDeltaNet's ``A_log``, ``dt_bias`` and norm weight kept fp32.

    The decay ``exp(A_log)`` and the gated norm lose too much precision in bf16 (small updates round away).
    ``_keep_in_fp32_modules_strict`` makes transformers' ``from_pretrained`` load them fp32 even with
    ``dtype=torch.bfloat16``; construction (``_from_config``, which the parallel loader uses on the meta device)
    does not apply that list, so ``__init__`` creates them fp32 too. It keeps transformers' class name, so
    ``save_pretrained`` writes the architecture transformers knows.
    """

    _keep_in_fp32_modules_strict = list(_KEEP_IN_FP32)

    def __init__(self, config: transformers.Qwen3_5TextConfig) -> None:
        super().__init__(config)
        _upcast_kept_parameters(self)


def _upcast_kept_parameters(model: torch.nn.Module) -> None:
    """Cast the ``_KEEP_IN_FP32`` parameters to fp32 when the model was built in a low-precision dtype."""
    pattern = re.compile("|".join(re.escape(name) for name in _KEEP_IN_FP32))
    for name, param in model.named_parameters():
        if pattern.search(name) and param.dtype in _LOW_PRECISION:
            param.data = param.data.to(torch.float32)


Qwen3_5ForCausalLM.parallelizer = PARALLELIZER
