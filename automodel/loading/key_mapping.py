"""Which checkpoint tensors make each model tensor, through transformers' own checkpoint conversion mapping.

transformers 5 renames legacy keys and merges per-expert tensors into fused expert parameters while loading
(``get_model_conversion_mapping``: ``WeightRenaming`` / ``WeightConverter`` with ``MergeModulelist``,
``Concatenate`` ...). We apply the same mapping to the checkpoint's key list, but instead of materialising the
converted tensors we describe each one as a lazy ``Source`` so every rank reads only the slices it holds. The
stacking and concatenation ops are described exactly; any other op falls back to running transformers' converter on
the full source tensors of that one parameter (memory bounded by one parameter), then slicing.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from automodel._compat.transformers import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    get_model_conversion_mapping,
    rename_source_key,
)

from .checkpoint_files import CheckpointFiles
from .quantized import DequantizedKeys
from .sources import Concatenated, Source, Stacked, StoredTensor, select

__all__ = ["KeyPlan", "plan_keys"]


@dataclass
class KeyPlan:
    """The checkpoint -> model mapping for one model and checkpoint."""

    sources: dict[str, Source] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # The transforms of transformers' conversion mapping that matched a key: what from_pretrained keeps on the model
    # (``_weight_conversions``) for save_pretrained to revert.
    conversions: list[WeightRenaming | WeightConverter] = field(default_factory=list)


def plan_keys(
    model: nn.Module,
    files: CheckpointFiles,
    model_names: dict[str, torch.Size],
    dequantized: DequantizedKeys | None = None,
) -> KeyPlan:
    """Map every checkpoint key onto ``model_names`` (state-dict name -> global shape).

    ``dequantized`` stands quantized tensors in for the float keys they represent (their codes and scales are not
    keys of their own). Keys the model does not have are ``unexpected``; model names no checkpoint key provides are
    ``missing``.
    """
    dequantized = dequantized or DequantizedKeys()
    stored = sorted({key for key in files.keys() if key not in dequantized.consumed} | set(dequantized.sources))

    def source_of(key: str) -> Source:
        return dequantized.sources.get(key) or StoredTensor(files, key, files.shape(key))

    # Building transformers' conversion table compiles about a thousand regexes (a third of a second) the first time:
    # skip it when every stored key already names a model tensor, as for most dense checkpoints.
    # Only transformers models have a conversion mapping; other models (diffusers) store their module tree's names.
    needs_conversion = isinstance(model, PreTrainedModel) and not all(key in model_names for key in stored)
    transforms = _conversion_mapping(model) if needs_conversion else []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    known = dict.fromkeys(model_names, True)

    plan = KeyPlan()
    groups: dict[str, tuple[WeightConverter, dict[str, list[str]]]] = {}
    for key in sorted(stored, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in known and key in known:
            target, pattern = rename_source_key(key, [], [], prefix, known)
        if target not in known:
            plan.unexpected.append(key)
        elif pattern is None:
            plan.sources[target] = source_of(key)
        else:
            converter, by_source = groups.setdefault(target, (by_pattern[pattern], {}))
            by_source.setdefault(pattern, []).append(key)
    for target, (converter, by_source) in groups.items():
        plan.sources.update(_converted_sources(model, source_of, target, converter, by_source))
    plan.missing = [name for name in model_names if name not in plan.sources]
    plan.conversions = [transform for transform in transforms if _was_used(transform)]
    return plan


def _was_used(transform: WeightRenaming | WeightConverter) -> bool:
    """Whether a transform matched a key while the keys were planned (transformers marks it; a version without the
    mark keeps every transform, as reverting one that matches nothing changes nothing)."""
    was_used = getattr(transform, "was_used", None)
    return was_used() if callable(was_used) else True


def _conversion_mapping(model: PreTrainedModel) -> list[WeightRenaming | WeightConverter]:
    """transformers' conversion mapping for ``model``, as for the transformers class it is: a sidecar's subclass is
    defined outside transformers, which transformers takes for custom code, so it would skip the root model's mapping
    and scope the one of the base model inside it (loading alike, but reverting a prefix rename such as Nemotron-H's
    ``backbone.`` -> ``model.`` no more, so the export and ``save_pretrained`` would store other names)."""
    native = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), type(model))
    if native is type(model) or not issubclass(native, PreTrainedModel):
        return get_model_conversion_mapping(model)
    own = type(model)
    model.__class__ = native  # for the lookup only (a meta model, not yet parallelized)
    try:
        return get_model_conversion_mapping(model)
    finally:
        model.__class__ = own


def _converted_sources(
    model: nn.Module,
    source_of: Callable[[str], Source],
    target: str,
    converter: WeightConverter,
    by_source: dict[str, list[str]],
) -> dict[str, Source]:
    ops = converter.operations
    patterns = [pattern for pattern in converter.source_patterns if pattern in by_source]

    def stacked(pattern: str, dim: int) -> Stacked:
        return Stacked([source_of(key) for key in by_source[pattern]], dim)

    if len(converter.target_patterns) == 1:
        if len(ops) == 1 and isinstance(ops[0], MergeModulelist) and len(patterns) == 1:
            return {target: stacked(patterns[0], ops[0].dim)}
        if len(ops) == 2 and isinstance(ops[0], MergeModulelist) and isinstance(ops[1], Concatenate):
            return {target: Concatenated([stacked(p, ops[0].dim) for p in patterns], ops[1].dim)}
        if len(ops) == 1 and isinstance(ops[0], Concatenate) and all(len(by_source[p]) == 1 for p in patterns):
            return {target: Concatenated([source_of(by_source[p][0]) for p in patterns], ops[0].dim)}
    conversion = _FullConversion(model, source_of, target, converter, by_source)
    return {name: _ConvertedTensor(conversion, name) for name in conversion.target_names()}


class _FullConversion:
    """Runs transformers' converter for one target on the full source tensors, once, when first read."""

    def __init__(self, model, source_of, target, converter, by_source) -> None:
        self.model, self.source_of, self.target = model, source_of, target
        self.converter, self.by_source = converter, by_source
        self._result: dict[str, torch.Tensor] | None = None

    def target_names(self) -> list[str]:
        names = [self.target]
        for pattern in self.converter.target_patterns[1:]:
            names.append(self.target.replace(self.converter.target_patterns[0], pattern))
        return names

    def result(self) -> dict[str, torch.Tensor]:
        if self._result is None:
            converter = copy.deepcopy(self.converter)
            for pattern, keys in self.by_source.items():
                for key in keys:
                    converter.add_tensor(self.target, key, pattern, lambda key=key: self._read_full(key))
            converted = converter.convert(self.target, model=self.model, config=self.model.config)
            self._result = {name: (value[0] if isinstance(value, list) else value) for name, value in converted.items()}
        return self._result

    def _read_full(self, key: str) -> torch.Tensor:
        source = self.source_of(key)
        return source.read([torch.arange(size) for size in source.shape])


@dataclass
class _ConvertedTensor:
    conversion: _FullConversion
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.conversion.result()[self.name].shape)

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        return select(self.conversion.result()[self.name], indices)

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(self.read(indices))

    def stored_keys(self) -> list[str]:
        return [key for keys in self.conversion.by_source.values() for key in keys]


def ignored(name: str, patterns: list[str] | None) -> bool:
    """Whether ``name`` matches one of transformers' ``_keys_to_ignore_on_load_*`` regexes."""
    return any(re.search(pattern, name) for pattern in patterns or ())
