"""Export a trained, parallelized model as a consolidated Hugging Face checkpoint, with a model card.

The export is what ``save_pretrained`` of the unsharded model would write (same tensor names, transformers' reverse
checkpoint conversion applied, tied weights once), byte for byte, written by every rank at once: rank 0 creates the
files from the shapes alone, each rank writes the bytes of the shards it holds at their offsets, and only the tensors
a conversion builds are gathered, each to one owner (``parallel_export``). Everything is written into a temporary
sibling directory that is renamed into place at the end.
The model card and the hub upload live in ``model_card`` (re-exported here).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from transformers import PreTrainedModel

from automodel._compat.transformers import remove_tied_weights_from_state_dict, revert_weight_conversion
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import is_rank_zero

from .agreement import agree_or_raise
from .checkpoint_files import with_variant
from .model_card import ModelCardInfo, push_to_hub, write_model_card
from .parallel_export import WeightFiles, gathered_to, make_staging_dir, write_weight_files

__all__ = [
    "ModelCardInfo",
    "push_to_hub",
    "replace_weights_in",
    "save_hf_checkpoint",
    "write_checkpoint",
    "write_model_card",
]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class _ExportPlan:
    """Which stored tensor comes from which model tensor, and which file holds it."""

    sources: dict[str, torch.Tensor]  # state-dict name -> the model's (possibly sharded) tensor
    source_of: dict[str, str]  # stored name -> state-dict name
    files: dict[str, list[str]]  # file name -> stored names, in writing order
    stored: dict[str, torch.Tensor]  # stored name -> a meta tensor of its shape and dtype
    renamed: set[str]  # the state-dict names whose stored tensor is the tensor itself, renamed at most
    index: dict[str, Any] | None  # model.safetensors.index.json, None for a single file
    dtype: torch.dtype  # the model's, recorded in config.json
    index_name: str = INDEX_NAME  # with the variant, if any


def save_hf_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    max_shard_size: str | int = "5GB",
    model_card: ModelCardInfo | None = None,
    model_id: str | None = None,
    overwrite: bool = False,
    variant: str | None = None,
) -> Path:
    """Collective (call on every rank): write ``model`` to ``directory`` as a checkpoint plain transformers loads.

    Writes safetensors shards named as ``save_pretrained`` names them (``model-0000x-of-0000y.safetensors`` +
    ``model.safetensors.index.json``, or one ``model.safetensors``), with the same tensor names (reverse checkpoint
    conversion applied, tied weights once), then ``config.json``, ``generation_config.json`` (when the model can
    generate), the tokenizer files (when ``tokenizer`` is given) and ``README.md`` (when ``model_card`` is given;
    its usage snippet names ``model_id``, by default the directory). Each rank writes the bytes of its own shards
    into the files (a replicated tensor by one of its holders); only a tensor that transformers' reverse conversion
    builds (fused MoE experts split per expert) is gathered, to one owner rank, spread over the ranks. No rank holds
    more than its shards and one gathered tensor. ``model`` is a ``PreTrainedModel`` (parallelized or not) or a
    wrapper (DDP, Megatron-FSDP) whose ``.module`` is one.

    The export is written into a temporary sibling directory and renamed into place at the end, so a failure leaves
    neither a half-written export nor the temporary directory. An existing non-empty ``directory`` is refused unless
    ``overwrite=True``. ``variant`` names the weight files as transformers does (``model.fp16.safetensors``). Every
    error is raised on every rank.
    """
    return write_checkpoint(
        model,
        directory,
        place=_replace_directory if overwrite else _new_directory,
        tokenizer=tokenizer,
        max_shard_size=max_shard_size,
        model_card=model_card,
        model_id=model_id,
        variant=variant,
    )


Placement = Callable[[Path, Path], None]


def write_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    place: Placement,
    tokenizer: Any = None,
    max_shard_size: str | int = "5GB",
    model_card: ModelCardInfo | None = None,
    model_id: str | None = None,
    variant: str | None = None,
) -> Path:
    """Collective: the export of :func:`save_hf_checkpoint`, staged beside ``directory`` and moved there by
    ``place(staging, target)`` (rank 0), which may refuse the target before anything is written (``place`` is
    called with a ``None`` staging directory first, to check)."""
    target = Path(directory).absolute()
    plan, error, gather = None, None, None
    try:
        inner = _transformers_model(model)
        _check_arguments(model if isinstance(model, PipelinedModel) else inner, tokenizer, model_card)
        if isinstance(model, PipelinedModel):
            gather = model.gatherer()
        if is_rank_zero():
            place(None, target)
        plan = _plan_export(inner, max_shard_size, variant)
    except Exception as exc:  # raised below on every rank, so that no rank goes on alone into a collective
        error = exc
    agree_or_raise(error, f"Exporting the model to {target}")
    staging = None
    try:
        staging = make_staging_dir(target, ".export-tmp")
        write_weight_files(staging, _weight_files(model, inner, plan, gather), f"the export to {target}")
        error = None
        try:
            if is_rank_zero():
                _write_metadata(inner, plan, staging, tokenizer, model_card, model_id or str(target))
                place(staging, target)
                staging = None
        except Exception as exc:
            error = exc
        agree_or_raise(error, f"Finishing the export to {target}")
    finally:
        if staging is not None and is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _transformers_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model itself, also inside a wrapper that keeps it as ``.module`` (DDP, Megatron-FSDP); for a
    pipelined model, the whole model on meta (names, shapes, ties, config: its tensors come from the stages)."""
    if isinstance(model, PipelinedModel):
        return model.whole_on_meta
    if isinstance(model, PreTrainedModel):
        return model
    inner = getattr(model, "module", None)
    if isinstance(inner, PreTrainedModel):
        return inner
    raise TypeError(
        f"save_hf_checkpoint exports a transformers PreTrainedModel (or a wrapper whose .module is one), got "
        f"{type(model).__name__}. Pass the model NeMoAutoModelForCausalLM returned."
    )


def _check_arguments(model: nn.Module, tokenizer: Any, model_card: ModelCardInfo | None) -> None:
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"tokenizer must have save_pretrained (a transformers tokenizer), got {type(tokenizer).__name__}."
        )
    if model_card is not None and not isinstance(model_card, ModelCardInfo):
        raise TypeError(f"model_card must be a ModelCardInfo, got {type(model_card).__name__}.")
    adapters = [name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    if adapters:
        raise ValueError(
            f"The model carries LoRA adapters ({adapters[0]} and {len(adapters) - 1} more): its checkpoint would hold "
            "peft's names (base_layer, lora_A), which transformers loads as missing weights. Fold them into the "
            "weights first with automodel.lora.merge_lora(model), or write the adapter alone with "
            "automodel.lora_checkpoint.save_lora_adapter(model, directory)."
        )
    on_meta = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if on_meta:
        raise ValueError(
            f"{len(on_meta)} tensors of the model are on the meta device (e.g. {on_meta[0]}): load or "
            "initialise the weights before exporting."
        )


def _plan_export(model: PreTrainedModel, max_shard_size: str | int, variant: str | None = None) -> _ExportPlan:
    """Decide names, files and the source of every stored tensor from shapes alone (no data is touched)."""
    sources = dict(model.state_dict())
    for key in model._keys_to_ignore_on_save or ():
        sources.pop(key, None)
    stand_ins = {name: _meta_like(tensor) for name, tensor in sources.items()}
    # On meta tensors transformers finds ties by the model's parameter objects, as save_pretrained does.
    stand_ins = remove_tied_weights_from_state_dict(stand_ins, model)
    sources = {name: sources[name] for name in stand_ins}
    stored = {name: _meta_like(tensor) for name, tensor in revert_weight_conversion(model, dict(stand_ins)).items()}
    source_of, renamed = _stored_sources(model, stand_ins, stored)
    try:
        split = split_torch_state_dict_into_shards(
            stored, filename_pattern=with_variant(WEIGHTS_PATTERN, variant), max_shard_size=max_shard_size
        )
    except ValueError as exc:
        raise ValueError(
            f"max_shard_size={max_shard_size!r} is not a size: {exc} Use e.g. '5GB' or a byte count."
        ) from exc
    index = None
    if split.is_sharded:
        total = {"total_parameters": model.num_parameters(), **split.metadata}
        index = {"metadata": total, "weight_map": split.tensor_to_filename}
    files = dict(split.filename_to_tensors)
    return _ExportPlan(
        sources, source_of, files, stored, renamed, index, model.dtype, with_variant(INDEX_NAME, variant)
    )


def _stored_sources(
    model: PreTrainedModel, stand_ins: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]
) -> tuple[dict[str, str], set[str]]:
    """Map each stored tensor to the one model tensor it is converted from, so tensors can be gathered one at a time,
    and tell the model tensors stored as they are (the conversion returns the tensor itself, under its name or
    another), which the ranks write from their shards.

    Holds when every reverse conversion reads one model tensor (renames, fused experts split into per-expert
    tensors); a conversion that builds one stored tensor from several model tensors is refused.
    """
    source_of: dict[str, str] = {}
    renamed: set[str] = set()
    mismatched = []
    for name, stand_in in stand_ins.items():
        converted = revert_weight_conversion(model, {name: stand_in})
        if len(converted) == 1 and next(iter(converted.values())) is stand_in:
            renamed.add(name)
        for stored_name, tensor in converted.items():
            source_of[stored_name] = name
            if stored_name not in stored or stored[stored_name].shape != tensor.shape:
                mismatched.append(stored_name)
    if mismatched or set(source_of) != set(stored):
        raise NotImplementedError(
            f"{type(model).__name__}'s checkpoint conversion builds stored tensors from several model tensors, which "
            "this export does not gather one at a time yet. Save the unsharded model with save_pretrained instead."
        )
    return source_of, renamed


def _weight_files(
    model: nn.Module,
    inner: PreTrainedModel,
    plan: _ExportPlan,
    gather: Callable[[str], torch.Tensor | None] | None,
) -> WeightFiles:
    """The export's weights for :func:`write_weight_files`: a stored tensor that is its model tensor (renamed at
    most) is written from the shards; one that transformers' reverse conversion builds (per-expert tensors of fused
    experts) is gathered whole to its owner and converted there. ``gather(name)`` (a pipelined model's) gives the full
    tensor on rank 0 and replaces ``full_tensor``."""
    direct = {name for name in plan.stored if plan.source_of[name] in plan.renamed}
    # A pipelined rank holds its stages' tensors under the whole model's names.
    local = dict(model.state_dict()) if isinstance(model, PipelinedModel) else plan.sources

    def gathered(source: str, owner: int) -> torch.Tensor | None:
        if gather is not None:
            return gather(source)
        return gathered_to(plan.sources[source], owner)

    def convert(source: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return revert_weight_conversion(inner, {source: full.detach().cpu()})

    return WeightFiles(
        files=plan.files,
        stored=plan.stored,
        source_of=plan.source_of,
        direct=direct,
        local=local,
        gather=gathered,
        convert=convert,
        gathers_to_rank_zero=gather is not None,
    )


def _write_metadata(
    model: PreTrainedModel,
    plan: _ExportPlan,
    staging: Path,
    tokenizer: Any,
    model_card: ModelCardInfo | None,
    model_id: str,
) -> None:
    """Rank 0: the index, configs, tokenizer files and model card next to the weights."""
    if plan.index is not None:
        (staging / plan.index_name).write_text(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(model.config)
    config.architectures = [_architecture_name(model)]
    config.dtype = str(plan.dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    if model_card is not None:
        write_model_card(staging, model_card, model_id=model_id)


def _new_directory(staging: Path | None, target: Path) -> None:
    """Placement: ``target`` must not exist or be empty; the export is renamed to it."""
    if staging is None:
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"{target} exists and is not a directory: export to a directory.")
        if target.is_dir() and any(target.iterdir()):
            raise FileExistsError(
                f"{target} already exists and is not empty: choose another directory, or pass overwrite=True to "
                "replace it."
            )
        return
    if target.exists():
        target.rmdir()
    staging.rename(target)


def _replace_directory(staging: Path | None, target: Path) -> None:
    """Placement: the export replaces ``target`` and everything in it; the old one is removed only after the rename."""
    if staging is None:
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"{target} exists and is not a directory: export to a directory.")
        return
    if not target.exists():
        staging.rename(target)
        return
    previous = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".replaced", dir=target.parent))
    target.rename(previous / target.name)
    try:
        staging.rename(target)
    except BaseException:
        (previous / target.name).rename(target)
        previous.rmdir()
        raise
    shutil.rmtree(previous)


def replace_weights_in(staging: Path | None, target: Path, variant: str | None = None) -> None:
    """Placement, as ``save_pretrained`` does it: the export's files go into ``target`` (created if needed), whose
    earlier weight files of the same ``variant`` are removed first; its other files (a tokenizer, a README, the
    weights of another variant) stay. Each file is replaced atomically."""
    if staging is None:
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"{target} exists and is not a directory: save to a directory.")
        return
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.iterdir():
        if stale.is_file() and _is_weight_file(stale.name, variant):
            stale.unlink()
    for path in staging.iterdir():
        os.replace(path, target / path.name)
    staging.rmdir()


def _is_weight_file(name: str, variant: str | None = None) -> bool:
    """Whether ``name`` is one of transformers' weight files of ``variant`` (none: the plain files): the single file,
    a shard, or the index, in safetensors or the legacy ``.bin``."""
    tag = rf"\.{re.escape(variant)}" if variant else ""
    single_or_shard = rf"(model|pytorch_model){tag}(-\d{{5}}-of-\d{{5}})?\.(safetensors|bin)"
    index = rf"(model\.safetensors|pytorch_model\.bin)\.index{tag}\.json"
    return re.fullmatch(f"{single_or_shard}|{index}", name) is not None


def _architecture_name(model: PreTrainedModel) -> str:
    """The transformers class name, not that of a dynamic subclass (FSDP2's ``FSDPLlamaForCausalLM``) or a sidecar."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith(("transformers.", "transformers_modules.")):
            return cls.__name__
    return type(model).__name__.removeprefix("FSDP")


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh meta tensor of ``tensor``'s global shape (its own storage, so sizes are counted per tensor)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
