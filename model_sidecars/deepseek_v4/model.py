"""The DeepSeek-V4 class the registry maps ``DeepseekV4ForCausalLM`` to: transformers' own, with its parallelizer."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["DeepseekV4ForCausalLM"]


class DeepseekV4ForCausalLM(transformers.DeepseekV4ForCausalLM):
    """transformers' DeepSeek-V4 causal LM (same name, so ``save_pretrained`` writes the same architecture), sharded
    with float32 FSDP units for the parameters it keeps in float32."""


DeepseekV4ForCausalLM.parallelizer = PARALLELIZER
