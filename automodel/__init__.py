"""automodel: load Hugging Face checkpoints straight into parallelized PyTorch models.

The public names are imported lazily, so ``import automodel`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "MeshContext": "automodel.distributed",
    "ModelParallelizer": "automodel.distributed",
    "FSDP2Config": "automodel.distributed",
    "DDPConfig": "automodel.distributed",
    "MegatronFSDPConfig": "automodel.distributed",
    "MoEConfig": "automodel.distributed",
    "NeMoAutoModel": "automodel.auto_model",
    "NeMoAutoModelForCausalLM": "automodel.auto_model",
    "NeMoAutoModelForImageTextToText": "automodel.auto_model",
    "NeMoAutoModelForSequenceClassification": "automodel.auto_model",
    "NeMoAutoDiffusionPipeline": "automodel.diffusion",
    "clip_grad_norm_": "automodel.distributed.grad_clipping",
    "plan": "automodel.planning",
    "Plan": "automodel.planning",
}

__all__ = [
    "DDPConfig",
    "FSDP2Config",
    "MegatronFSDPConfig",
    "MeshContext",
    "MoEConfig",
    "ModelParallelizer",
    "NeMoAutoDiffusionPipeline",
    "NeMoAutoModel",
    "NeMoAutoModelForCausalLM",
    "NeMoAutoModelForImageTextToText",
    "NeMoAutoModelForSequenceClassification",
    "Plan",
    "clip_grad_norm_",
    "plan",
]

if TYPE_CHECKING:
    from automodel.auto_model import (
        NeMoAutoModel,
        NeMoAutoModelForCausalLM,
        NeMoAutoModelForImageTextToText,
        NeMoAutoModelForSequenceClassification,
    )
    from automodel.diffusion import NeMoAutoDiffusionPipeline
    from automodel.distributed import (
        DDPConfig,
        FSDP2Config,
        MegatronFSDPConfig,
        MeshContext,
        ModelParallelizer,
        MoEConfig,
    )
    from automodel.distributed.grad_clipping import clip_grad_norm_
    from automodel.planning import Plan, plan


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # The checkpoint writer behind save_pretrained of parallelized models registers itself on import.
        importlib.import_module("automodel.loading")
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'automodel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
