"""Load a checkpoint directory into a model that is already parallelized (and still on the meta device)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automodel._compat.torch import apply_to_tensors, dtensor_like
from automodel.distributed.model_structure import retie_parameters, tied_parameter_names
from automodel.distributed.runtime import is_rank_zero

from .agreement import agree_or_raise
from .checkpoint_files import CheckpointError, CheckpointFiles, open_checkpoint
from .initialization import UninitializedTensorError, initialize_missing
from .key_mapping import KeyPlan, ignored, plan_keys
from .quantized import DequantizedKeys, QuantizationScheme, dequantized_keys
from .sharded_loader import LoadReport, load_into, peak_rss_bytes, state_tensors
from .sources import Source, StoredTensor
from .tied_copies import untie_differing_copies

__all__ = ["CheckpointPlan", "load_checkpoint", "materialize", "plan_checkpoint"]

logger = logging.getLogger(__name__)


def materialize(model: nn.Module, device: torch.device | str) -> set[str]:
    """Allocate storage for every parameter and buffer still on the meta device (only the local shards of sharded
    ones), keeping ties; return the names of the tensors it allocated.

    Tensors that already hold data stay the same objects: a strategy that allocates its own parameter storage
    (Megatron-FSDP) keeps it, and a diffusers model keeps the buffers it computed at construction.
    """
    tied = tied_parameter_names(model)
    allocated: set[str] = set()
    if all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        apply_to_tensors(model, _empty_on(device))
        allocated = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    else:
        for module_name, module in model.named_modules():
            own = {**module._parameters, **module._buffers}
            if not any(t is not None and t.is_meta for t in own.values()):
                continue
            kept = {name: t for name, t in own.items() if t is not None and not t.is_meta}
            apply_to_tensors(module, _empty_on(device), recurse=False)
            for name, tensor in kept.items():
                (module._parameters if name in module._parameters else module._buffers)[name] = tensor
            prefix = f"{module_name}." if module_name else ""
            allocated |= {f"{prefix}{name}" for name, t in own.items() if t is not None and name not in kept}
    retie_parameters(model, tied)
    # Under the names the tied model has (allocating unties a group for a moment; its aliases are no tensors of their
    # own).
    return allocated & ({name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()})


def _empty_on(device: torch.device | str):
    """``Module.to_empty``'s ``empty_like``, with a ``DTensor``'s local shard allocated directly and wrapped in the same
    spec: ``empty_like`` on a sharded meta ``DTensor`` goes through DTensor's sharding propagation (0.013 s of CPU per
    rank for a 1 GB Llama on 4 ranks), ``DTensor.from_local`` through an autograd function (0.004 s)."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return torch.empty_like(tensor, device=device)
        local = tensor.to_local()
        return dtensor_like(torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device), tensor)

    return empty


@dataclass
class CheckpointPlan:
    """A checked checkpoint: its files and, for each model tensor, the lazy source it is read from."""

    directory: Path
    files: CheckpointFiles
    keys: KeyPlan
    quantization: QuantizationScheme | None = None
    dequantized: int = 0  # quantized tensors of the checkpoint, dequantized on read


def plan_checkpoint(
    model: nn.Module,
    directory: Path,
    *,
    strict: bool = True,
    use_safetensors: bool | None = None,
    variant: str | None = None,
    quantization: QuantizationScheme | None = None,
) -> CheckpointPlan:
    """Check the checkpoint in ``directory`` against ``model`` (built on meta, not yet parallelized) on every rank.

    Opens every file (a missing, truncated or corrupt shard fails here), maps its keys through transformers'
    conversion mapping, and compares shapes. Missing or unexpected keys are an error listing them unless
    ``strict=False``. A checkpoint quantized as ``quantization`` says is dequantized on read; quantized tensors
    without it are an error. A failure any rank sees is raised on every rank, before anything is allocated or read.
    """
    plan, error = None, None
    try:
        files = open_checkpoint(directory, use_safetensors=use_safetensors, variant=variant)
        files.validate()
        dequantized = dequantized_keys(files, quantization)
        keys = _checked_keys(model, files, strict=strict, dequantized=dequantized)
        plan = CheckpointPlan(directory, files, keys, quantization, len(dequantized.sources))
    except (CheckpointError, ValueError, OSError) as exc:
        error = exc
    agree_or_raise(error, f"Checking the checkpoint in {directory}")
    return plan


def load_checkpoint(
    model: nn.Module,
    plan: CheckpointPlan,
    *,
    progress: bool = True,
    seed: int = 0,
    allocated: set[str] | None = None,
    close: bool = True,
) -> LoadReport:
    """Fill ``model`` (parallelized and materialized) from a checked ``plan``: each rank reads only the slices of
    its own shards. Every tensor of ``allocated`` (default: all of them, as after a meta-device build) that the
    checkpoint does not fill gets the model's own init: missing keys (those the model says to ignore included),
    non-persistent buffers, persistent buffers a checkpoint leaves out. One that no init writes either is an
    ``UninitializedTensorError`` on every rank: never uninitialised memory in a model. ``close=False`` leaves the
    checkpoint's files open for another model read from the same plan (the next pipeline stage of this rank)."""
    start = time.perf_counter()
    report = LoadReport()
    error = None
    try:
        report.loaded = load_into(model, plan.keys.sources, progress=progress and is_rank_zero())
    except (CheckpointError, RuntimeError, OSError) as exc:
        error = exc
    finally:
        if close:
            plan.files.close()
    agree_or_raise(error, f"Reading the weights from {plan.directory}")
    report.initialized = sorted(plan.keys.missing)
    if allocated is None:
        allocated = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    error = None
    try:
        initialize_missing(model, allocated - set(plan.keys.sources), seed=seed)
    except UninitializedTensorError as exc:
        error = exc
    agree_or_raise(error, f"Initialising what {plan.directory} does not hold")
    report.bytes_read = plan.files.bytes_read
    report.bytes_spanned = plan.files.bytes_spanned
    if plan.quantization is not None:
        report.dequantized = f"{plan.dequantized} tensors from {plan.quantization.describe()}"
    report.seconds = time.perf_counter() - start
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _checked_keys(
    model: nn.Module, files: CheckpointFiles, *, strict: bool, dequantized: DequantizedKeys | None = None
) -> KeyPlan:
    tensors = dict(state_tensors(model))
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    groups = tied_parameter_names(model)
    aliases = {alias: group[0] for group in groups for alias in group[1:]}
    plan = plan_keys(model, files, {**shapes, **dict.fromkeys(aliases)}, dequantized)
    untied = untie_differing_copies(model, plan.sources, groups)
    if untied:  # each now a tensor of the model, with a shape to check
        tensors = dict(state_tensors(model))
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        aliases = {alias: primary for alias, primary in aliases.items() if alias not in untied}
    _fold_tied_aliases(plan, aliases)
    plan.missing = [n for n in plan.missing if not ignored(n, getattr(model, "_keys_to_ignore_on_load_missing", None))]
    unexpected_patterns = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *_legacy_buffers(model)]
    plan.unexpected = [key for key in plan.unexpected if not ignored(key, unexpected_patterns)]
    plan.unexpected = _without_task_heads(model, plan.unexpected, files.keys())
    problems = []
    if strict and plan.missing:
        problems.append(f"missing from the checkpoint: {_listing(plan.missing)}")
    if strict and plan.unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listing(plan.unexpected)}")
    mismatched = [
        f"{name} (checkpoint {tuple(source.shape)} from {source.stored_keys()[:2]}, model {shapes[name]})"
        for name, source in plan.sources.items()
        if tuple(source.shape) != shapes[name]
    ]
    if mismatched:
        problems.append(f"shapes that disagree with the config: {_listing(mismatched)}")
    # Integer codes (packed or quantized weights) cast to a float parameter would be silently wrong values.
    integers = [
        f"{name} (stored {source.key} as {files.dtype(source.key)})"
        for name, source in plan.sources.items()
        if isinstance(source, StoredTensor)
        and tensors[name].is_floating_point()
        and not (files.dtype(source.key) or torch.float32).is_floating_point
    ]
    if integers:
        problems.append(f"integer tensors for float parameters (quantized or packed weights?): {_listing(integers)}")
    if problems:
        keys_differ = strict and (plan.missing or plan.unexpected)
        hint = ". Pass strict=False to initialise missing tensors and ignore unexpected ones." if keys_differ else "."
        raise CheckpointError(f"The checkpoint does not match {type(model).__name__}: " + "; ".join(problems) + hint)
    return plan


def _without_task_heads(model: nn.Module, unexpected: list[str], stored: Iterable[str]) -> list[str]:
    """``unexpected`` less the heads of a task model when ``model`` is its base model (``AutoModel`` on a
    ``...ForCausalLM`` checkpoint): the checkpoint stores the base model under ``base_model_prefix`` (``model.``),
    and what lies outside it (``lm_head.weight``, ``score.weight``) is the task's head, which a base model has no
    place for. transformers drops those too (with a report); a key under the prefix that the model lacks stays
    unexpected."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not unexpected or not prefix or getattr(model, "base_model", None) is not model:
        return unexpected
    under_prefix = f"{prefix}."
    if not any(key.startswith(under_prefix) for key in stored):
        return unexpected
    heads = [key for key in unexpected if not key.startswith(under_prefix)]
    if heads and is_rank_zero():
        logger.info("Left out of %s, which has no head: %s", type(model).__name__, _listing(heads))
    return [key for key in unexpected if key.startswith(under_prefix)]


def _legacy_buffers(model: nn.Module) -> list[str]:
    """transformers' exceptions for buffers that old checkpoints still carry (``_adjust_missing_and_unexpected_keys``):
    the rotary ``inv_freq`` moved off the checkpoint, and ``position_ids`` became non-persistent; ignored as unexpected
    keys where the model has such a buffer."""
    names = [name for name, _ in model.named_buffers()]
    patterns = []
    if any(name.endswith("rotary_emb.inv_freq") for name in names):
        patterns.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in names):
        patterns.append(r"(^|\.)position_ids$")
    return patterns


def _fold_tied_aliases(plan: KeyPlan, aliases: dict[str, str]) -> None:
    """A tied parameter is loaded once, under its first name, from whichever of its names the checkpoint has."""
    for alias, primary in aliases.items():
        source: Source | None = plan.sources.pop(alias, None)
        if source is not None and primary not in plan.sources:
            plan.sources[primary] = source
    loaded = set(plan.sources)
    plan.missing = [name for name in plan.missing if name not in aliases and name not in loaded]


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")
