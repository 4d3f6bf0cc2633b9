"""The Doge causal LM as the registry loads it: transformers' class with the sidecar parallelizer attached."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["DogeForCausalLM"]


class DogeForCausalLM(transformers.DogeForCausalLM):
    """transformers' ``DogeForCausalLM`` (same name, so ``save_pretrained`` writes the same architecture), with its
    attention kept replicated under TP."""


DogeForCausalLM.parallelizer = PARALLELIZER
