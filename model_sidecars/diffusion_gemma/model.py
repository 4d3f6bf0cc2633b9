"""The DiffusionGemma class the registry maps ``DiffusionGemmaForBlockDiffusion`` to: transformers' own, with its
parallelizer."""

from __future__ import annotations

import transformers

from .parallelization import PARALLELIZER

__all__ = ["DiffusionGemmaForBlockDiffusion"]


class DiffusionGemmaForBlockDiffusion(transformers.DiffusionGemmaForBlockDiffusion):
    """transformers' block-diffusion DiffusionGemma (same name, so ``save_pretrained`` writes the same architecture),
    sharded with the routed experts as FSDP units of their own."""


DiffusionGemmaForBlockDiffusion.parallelizer = PARALLELIZER
