"""The Nemotron-H causal LM as the registry loads it: transformers' class with the sidecar parallelizer attached."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["NemotronHForCausalLM"]


class NemotronHForCausalLM(transformers.NemotronHForCausalLM):
    """transformers' ``NemotronHForCausalLM``, parallelized by the Nemotron-H sidecar.

    It keeps transformers' class name, so ``save_pretrained`` writes the architecture transformers knows.
    """


NemotronHForCausalLM.parallelizer = PARALLELIZER
