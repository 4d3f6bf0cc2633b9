"""Tied parameters whose checkpoint holds each name with its own values: untied before the model is parallelized, as
transformers unties them.

A config that ties the input embedding to the output head (``tie_word_embeddings=True``) while the checkpoint holds
both ``embed_tokens.weight`` and ``lm_head.weight`` with different values describes the checkpoint wrongly.
transformers' ``tie_weights`` then warns and keeps the two apart ("both are present in the checkpoints with different
values, so we will NOT tie them"); tying them would silently drop one of the checkpoint's tensors. Here the model is
still on the meta device when the checkpoint is checked, so the copy is given a parameter of its own there, and the
parallelizer, the loader and the export all see an untied model.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from automodel.distributed.runtime import log_rank_zero

from .sources import Source

__all__ = ["untie_differing_copies"]

logger = logging.getLogger(__name__)

# The most a comparison holds of each tensor at once.
_CHUNK_BYTES = 64 * 2**20


def untie_differing_copies(model: nn.Module, sources: dict[str, Source], groups: list[list[str]]) -> set[str]:
    """Untie, in ``model`` (on the meta device), each name of a tied group (``groups``: names sharing one parameter)
    whose checkpoint tensor (``sources``, by model name) differs from the group's first tensor the checkpoint holds,
    compared in the model's dtype as transformers compares them. Returns the names untied; every rank reads the same
    files, so every rank unties the same names."""
    untied: set[str] = set()
    for group in groups:
        present = [name for name in group if name in sources]
        if len(present) < 2:
            continue
        reference = present[0]
        dtype = model.get_parameter(reference).dtype
        for name in present[1:]:
            if _equal(sources[reference], sources[name], dtype):
                continue
            _give_own_parameter(model, name)
            untied.add(name)
            log_rank_zero(
                logger,
                "The config of %s ties %s to %s, but the checkpoint holds both with different values, so they are "
                "NOT tied (as transformers does). Set tie_word_embeddings=False in the config to silence this.",
                type(model).__name__,
                name,
                reference,
                level=logging.WARNING,
            )
    return untied


def _equal(first: Source, second: Source, dtype: torch.dtype) -> bool:
    """Whether two stored tensors hold the same values in ``dtype``, read chunk by chunk along the first dim (one
    chunk of each in memory, and the first chunk that differs ends the comparison)."""
    shape = tuple(first.shape)
    if shape != tuple(second.shape):
        return False
    if not shape:
        return torch.equal(first.read([]).to(dtype), second.read([]).to(dtype))
    row_bytes = math.prod(shape[1:]) * max(dtype.itemsize, 4)
    rows = max(1, _CHUNK_BYTES // max(1, row_bytes))
    rest = [torch.arange(size) for size in shape[1:]]
    for start in range(0, shape[0], rows):
        indices = [torch.arange(start, min(start + rows, shape[0])), *rest]
        if not torch.equal(first.read(indices).to(dtype), second.read(indices).to(dtype)):
            return False
    return True


def _give_own_parameter(model: nn.Module, name: str) -> None:
    """Replace the shared parameter at ``name`` by a new meta parameter of the same shape, dtype and trainability, and
    drop the ties naming it from transformers' record of them (``all_tied_weights_keys``, which ``save_pretrained``
    and ``tie_weights`` read)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    shared = module._parameters[leaf]
    module._parameters[leaf] = nn.Parameter(torch.empty_like(shared, device="meta"), requires_grad=shared.requires_grad)
    ties = getattr(model, "all_tied_weights_keys", None)
    if isinstance(ties, dict):
        model.all_tied_weights_keys = {
            target: source for target, source in ties.items() if name not in (target, source)
        }
