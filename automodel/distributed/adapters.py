"""TP placements of adapter layers (peft's LoRA) that wrap a layer the TP plan names: derived from the base layer's
style, with no per-model code.

An adapter layer keeps its base layer as ``base_layer`` and its low-rank factors as ``lora_A`` / ``lora_B`` (one
entry per adapter name) and computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. A plan rule that names
the wrapped layer moves to ``base_layer``, and the factors follow its layout so that the two terms have the same one:

==================  ====================================  ===============================================
base style          ``lora_A``                            ``lora_B``
==================  ====================================  ===============================================
colwise family      replicated (its input made local)     the base style (its output sharded alike)
rowwise family      the base style (input sharded alike)  replicated (gradients summed over TP under SP)
none                replicated                            replicated
==================  ====================================  ===============================================

The rank dimension is never split. Any other style on an adapted layer (an embedding, MLA, experts), and adapters
on a sharded embedding, are refused.
Adapter layers are recognised by their structure (``base_layer`` plus ``lora_A`` / ``lora_B`` module dicts), so
shared code imports no adapter library.
"""

from __future__ import annotations

from torch import nn

__all__ = ["LOCAL_INPUT_STYLE", "adapter_placements", "is_adapter_layer"]

#: Our style for a replicated layer that must compute on the local tensor of a (replicated) DTensor input.
LOCAL_INPUT_STYLE = "replicated_local_input"

_COLWISE = frozenset({"colwise", "packed_colwise", "colwise_gather_output", "colwise_rep"})
_ROWWISE = frozenset({"rowwise", "rowwise_split_input", "rowwise_rep"})
_FACTORS = ("lora_A", "lora_B")


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` wraps a base layer with low-rank adapter factors (peft's ``LoraLayer`` structure)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and all(
        isinstance(getattr(module, factor, None), nn.ModuleDict) for factor in _FACTORS
    )


def adapter_placements(model: nn.Module, expanded: dict[str, str], sequence_parallel: bool) -> dict[str, str]:
    """``expanded`` (a TP plan with exact names) with every rule on an adapter layer replaced by the rules of its
    base layer and factors; raises, naming the layer, for a style adapters cannot follow."""
    modules = dict(model.named_modules())
    placed: dict[str, str] = {}
    for name, style in expanded.items():
        module = modules.get(name)
        if module is None or not is_adapter_layer(module):
            placed[name] = style
            continue
        placed[f"{name}.base_layer"] = style
        if style == "replicate":
            continue
        # peft keeps an embedding's factors as parameters (lora_embedding_A / _B) beside empty lora_A / lora_B.
        linear = len(module.lora_A) > 0 and not len(getattr(module, "lora_embedding_A", ()))
        if not linear or style not in _COLWISE | _ROWWISE:
            raise ValueError(
                f"LoRA adapters on {name} cannot follow its TP style {style!r}: they follow the linear layers of "
                "colwise and rowwise rules only. Leave it out of the LoRA config's target_modules, or use tp_size=1."
            )
        for adapter in module.lora_A:
            a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
            if style in _COLWISE:
                placed[a] = LOCAL_INPUT_STYLE
                placed[b] = style
            else:
                placed[a] = style
                if sequence_parallel:  # lora_B then computes on sequence shards: its gradient is partial
                    placed[b] = "replicated_with_grad_allreduce"
    return placed
