"""Rank-side cases for the loader's bad inputs and hub resolution (run inside ``tests.harness.RankPool`` workers).

Every case takes the same arguments on every rank; where one rank must see something different (a failure only
that rank sees), the argument is a per-rank list and each rank picks its own entry.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.runtime import full_tensor
from automodel.loading import resolve_checkpoint_dir
from tests.tiny_models import token_batch


def _this_rank(value: Any) -> Any:
    """``value[rank]`` for a per-rank list, else ``value`` itself."""
    if isinstance(value, list):
        return value[dist.get_rank() if dist.is_initialized() else 0]
    return value


def _context(layout: dict[str, Any] | None) -> MeshContext | None:
    return MeshContext.build(**layout) if layout is not None else None


def load_error(checkpoint: str | list[str], layout: dict[str, Any] | None, **kwargs: Any) -> str:
    """``"<ErrorType>: <message>"`` of what ``from_pretrained`` raises on this rank, or ``"no error"``.

    ``checkpoint`` and the values of ``kwargs`` may be per-rank lists.
    """
    kwargs = {key: _this_rank(value) for key, value in kwargs.items()}
    try:
        NeMoAutoModelForCausalLM.from_pretrained(_this_rank(checkpoint), mesh_context=_context(layout), **kwargs)
    except Exception as error:  # every failure type is part of what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


def load_error_bases(checkpoint: str, layout: dict[str, Any] | None) -> list[str]:
    """The class names of the exception ``from_pretrained`` raises (its whole MRO), or ``[]`` when it loads."""
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=_context(layout))
    except Exception as error:  # the classes are what the test checks
        return [cls.__name__ for cls in type(error).__mro__]
    return []


def loaded_logits(checkpoint: str, layout: dict[str, Any] | None, **kwargs: Any) -> dict[str, Any]:
    """Load ``checkpoint`` with ``from_pretrained(..., **kwargs)``; compare its logits with plain transformers'
    ``from_pretrained`` of the same ``checkpoint`` and ``kwargs`` (hub ids included)."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=_context(layout), **kwargs)
    reference_kwargs = {key: value for key, value in kwargs.items() if key != "strict"}
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, **reference_kwargs)
    batch = token_batch()
    with torch.no_grad():
        logits = full_tensor(model(batch).logits)
        expected = reference(batch).logits
    return {
        "logits": (logits - expected).abs().max().item(),
        "logits_sum": logits.double().sum().item(),
        "on_meta": [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
        "class": type(model).__name__,
        "name_or_path": getattr(model, "name_or_path", None),
    }


def resolved_directory(name_or_path: str, **kwargs: Any) -> str:
    """Where ``resolve_checkpoint_dir`` finds ``name_or_path`` on this rank (the once-per-node hub path)."""
    kwargs = {key: _this_rank(value) for key, value in kwargs.items()}
    return str(resolve_checkpoint_dir(name_or_path, **kwargs))


def initialised_missing_tensor(checkpoint: str, layout: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """Load with ``strict=False``: the full value of the missing (so initialised) parameter ``name``, its local shape,
    and the largest difference of every other parameter to plain transformers loading the same checkpoint."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=_context(layout), strict=False)
    reference = dict(AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters())
    parameters = dict(model.named_parameters())
    missing = parameters.pop(name)
    others = [
        (full_tensor(parameter).detach() - reference[other]).abs().max().item()
        for other, parameter in parameters.items()
    ]
    local = missing.to_local() if isinstance(missing, DTensor) else missing
    return {
        "value": full_tensor(missing).detach().clone(),
        "local_shape": tuple(local.shape),
        "others": max(others),
        "on_meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
    }


def untied_copies(checkpoint: str, layout: dict[str, Any] | None, export: str) -> dict[str, Any]:
    """Load ``checkpoint`` (its config ties the embedding and the head, its files hold both, with different values)
    under ``layout``, pipeline stages included: whether this rank's head and embedding are one parameter, the
    largest difference of every parameter this rank holds to plain transformers' load of the same checkpoint; then
    the export to ``export`` and, on rank 0, the largest difference of plain transformers' reload of it."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=_context(layout))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    expected = dict(reference.named_parameters())
    parameters = dict(model.named_parameters())
    every_name = dict(model.named_parameters(remove_duplicate=False))
    head, embedding = every_name.get("lm_head.weight"), every_name.get("model.embed_tokens.weight")
    differences = {
        name: (full_tensor(p).detach() - expected[name]).abs().max().item() for name, p in parameters.items()
    }
    model.save_pretrained(export)
    result = {"tied_here": head is not None and head is embedding, "held": sorted(parameters), "loaded": differences}
    if not dist.is_initialized() or dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        result["reloaded_tied"] = reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
        result["reloaded"] = max((t - expected[name]).abs().max().item() for name, t in reloaded.named_parameters())
    return result
