"""Model-owned parallelization policy, one folder per model family.

``SIDECAR_CLASSES`` maps a transformers architecture name (``config.architectures[0]``) to the import path of the
sidecar model class that carries a ``parallelizer`` attribute. Entries are imported only when looked up.
"""

from __future__ import annotations

import importlib

__all__ = ["SIDECAR_CLASSES", "sidecar_class"]

SIDECAR_CLASSES: dict[str, str] = {
    "DeepseekV4ForCausalLM": "model_sidecars.deepseek_v4.model.DeepseekV4ForCausalLM",
    "DiffusionGemmaForBlockDiffusion": "model_sidecars.diffusion_gemma.model.DiffusionGemmaForBlockDiffusion",
    "DogeForCausalLM": "model_sidecars.doge.model.DogeForCausalLM",
    "Gemma3nForCausalLM": "model_sidecars.gemma3n.model.Gemma3nForCausalLM",
    "Gemma4ForConditionalGeneration": "model_sidecars.gemma4.model.Gemma4ForConditionalGeneration",
    "NemotronHForCausalLM": "model_sidecars.nemotron_h.model.NemotronHForCausalLM",
    "Qwen3_5ForCausalLM": "model_sidecars.qwen3_5.model.Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "model_sidecars.qwen3_5.model.Qwen3_5MoeForCausalLM",
}


def sidecar_class(architecture: str) -> type | None:
    """The sidecar model class registered for ``architecture``, or ``None`` to use the transformers class."""
    path = SIDECAR_CLASSES.get(architecture)
    if path is None:
        return None
    module_name, _, class_name = path.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)
