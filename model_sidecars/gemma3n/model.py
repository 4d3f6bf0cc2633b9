"""The Gemma 3n text causal LM as the registry loads it: transformers' class with the sidecar parallelizer."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["Gemma3nForCausalLM"]


class Gemma3nForCausalLM(transformers.Gemma3nForCausalLM):
    """transformers' ``Gemma3nForCausalLM`` (same name, so ``save_pretrained`` writes the same architecture), whose
    activation-sparse MLPs stay replicated under TP."""


Gemma3nForCausalLM.parallelizer = PARALLELIZER
