"""The Qwen3.5 text causal LMs (dense and MoE) as the registry loads them: GatedDeltaNet's decay and norm parameters
kept in fp32."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


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


class Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeForCausalLM):
    """transformers' ``Qwen3_5MoeForCausalLM`` (GatedDeltaNet and attention over routed experts), with the same fp32
    parameters and dtype-uniform FSDP units as the dense Qwen3.5; its experts take the unified MoE path under EP."""

    _keep_in_fp32_modules_strict = Qwen3_5ForCausalLM._keep_in_fp32_modules_strict


Qwen3_5MoeForCausalLM.parallelizer = PARALLELIZER
