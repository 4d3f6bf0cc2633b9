"""The Gemma 4 model as the registry loads it: transformers' class with the sidecar parallelizer attached."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["Gemma4ForConditionalGeneration"]


class Gemma4ForConditionalGeneration(transformers.Gemma4ForConditionalGeneration):
    """transformers' ``Gemma4ForConditionalGeneration`` (same name, so ``save_pretrained`` writes the same
    architecture), whose tied embedding and head stay replicated under TP when it reads the embedding directly."""


Gemma4ForConditionalGeneration.parallelizer = PARALLELIZER
