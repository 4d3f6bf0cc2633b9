"""The Qwen3.5 text causal LM as the registry loads it: GatedDeltaNet's decay and norm parameters kept in fp32."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["Qwen3_5ForCausalLM"]


class Qwen3_5ForCausalLM(transformers.Qwen3_5ForCausalLM):
    """transformers' ``Qwen3_5ForCausalLM`` with GatedDeltaNet's ``A_log``, ``dt_bias`` and norm weight kept fp32.

    The decay ``exp(A_log)`` and the gated norm lose too much precision in bf16 (small updates round away);
    ``dt_bias`` is owned by the same module as ``A_log`` (a module's direct parameters always land in one FSDP unit),
    so it shares its dtype. ``_keep_in_fp32_modules_strict`` makes transformers' ``from_pretrained`` and the parallel
    loader's meta build (``automodel.auto_model``) keep them fp32 with ``dtype=torch.bfloat16``. It keeps
    transformers' class name, so ``save_pretrained`` writes the architecture transformers knows.
    """

    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "linear_attn.norm"]


Qwen3_5ForCausalLM.parallelizer = PARALLELIZER
