"""LoRA adapter checkpoints as peft writes and reads them: ``adapter_model.safetensors`` + ``adapter_config.json``.

``save_lora_adapter`` (collective) gathers the adapter factors of a parallelized model one tensor at a time and rank 0
writes what ``PeftModel.save_pretrained`` writes: the same tensor names (``base_model.model.<layer>.lora_A.weight``)
and the same config (inference mode, the base model's name and class). ``read_lora_adapter`` opens such a folder for
``from_pretrained(..., lora_adapter=...)``, which reads each rank's slices of the factors like any checkpoint.
"""

from __future__ import annotations

import copy
import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import is_rank_zero
from automodel.loading.agreement import agree_or_raise
from automodel.loading.checkpoint_files import CheckpointFiles, open_safetensors_file
from automodel.loading.parallel_export import WeightFiles, gathered_to, make_staging_dir, write_weight_files
from automodel.loading.pipeline import transformers_model

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraAdapter", "peft_key", "read_lora_adapter", "save_lora_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A.", ".lora_B.")


@dataclass
class LoraAdapter:
    """An adapter folder opened for loading: its peft config and its tensors (read slice by slice)."""

    directory: Path
    config: Any  # peft.LoraConfig
    files: CheckpointFiles


def require_peft() -> Any:
    """Import ``peft``, or say how to install it."""
    try:
        return importlib.import_module("peft")
    except ImportError as error:
        raise ImportError('LoRA needs the peft package: pip install "automodel[peft]".') from error


def peft_key(name: str, adapter_name: str = "default") -> str:
    """The name peft stores a factor under: ``x.lora_A.default.weight`` -> ``base_model.model.x.lora_A.weight``."""
    for factor in _FACTORS:
        name = name.replace(f"{factor}{adapter_name}.", factor)
    return _PEFT_PREFIX + name


def adapter_parameter_names(model: nn.Module, adapter_name: str = "default") -> list[str]:
    """The names of ``model``'s factors of one adapter, in module order."""
    return [
        name for name, _ in model.named_parameters() if any(f"{factor}{adapter_name}." in name for factor in _FACTORS)
    ]


def read_lora_adapter(directory: str | os.PathLike) -> LoraAdapter:
    """Open a peft adapter folder: its ``adapter_config.json`` as a ``LoraConfig`` and ``adapter_model.safetensors``
    (a truncated or corrupt file fails here)."""

    peft = require_peft()
    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(
            f"{directory} has no {ADAPTER_CONFIG}, so it is not a peft adapter folder (one written by "
            "PeftModel.save_pretrained or automodel.lora_checkpoint.save_lora_adapter)."
        )
    config = peft.PeftConfig.from_pretrained(directory)
    if not isinstance(config, peft.LoraConfig):
        raise ValueError(f"{directory} holds a {type(config).__name__} adapter; only LoRA adapters are loaded.")
    config.inference_mode = False
    return LoraAdapter(directory, config, open_safetensors_file(directory / ADAPTER_WEIGHTS))


def save_lora_adapter(model: nn.Module, directory: str | os.PathLike, *, adapter_name: str = "default") -> Path:
    """Collective (call on every rank): write the LoRA adapter of a (parallelized) model to ``directory`` as peft's
    ``save_pretrained`` writes it: ``adapter_model.safetensors`` and ``adapter_config.json``. Each rank writes the
    bytes of its own shards of the factors (``parallel_export``: nothing is gathered) into a temporary sibling folder
    whose files then replace those in ``directory`` (other files stay). Every error is raised on every rank."""
    target = Path(directory).absolute()
    inner, names, error = None, [], None
    pipelined = isinstance(model, PipelinedModel)
    try:
        inner = model.whole_on_meta if pipelined else transformers_model(model)  # the names, config and class
        config = getattr(inner, "peft_config", {}).get(adapter_name)
        names = adapter_parameter_names(inner, adapter_name)
        if config is None or not names:
            raise ValueError(
                f"{type(inner).__name__} has no LoRA adapter {adapter_name!r} (load it with peft_config= or "
                "lora_adapter=, and save before merge_lora folds it into the base weights)."
            )
    except Exception as exc:  # raised below on every rank
        error = exc
    agree_or_raise(error, f"Saving the LoRA adapter to {target}")
    wanted = set(names)
    shapes = {name: param for name, param in inner.named_parameters() if name in wanted}  # on meta under PP
    # This rank's factors (under PP, its stages'), written where they are; the others come from their holders.
    parameters = {name: param.detach() for name, param in model.named_parameters() if name in wanted}
    gather = model.gatherer() if pipelined else None  # a pipelined model's tensors reach rank 0 from their stage
    stored = {peft_key(name, adapter_name): name for name in names}
    spec = WeightFiles(
        files={ADAPTER_WEIGHTS: list(stored)},
        stored={
            key: torch.empty(shapes[name].shape, dtype=shapes[name].dtype, device="meta")
            for key, name in stored.items()
        },
        source_of=stored,
        direct=set(stored),  # the factors are stored as they are, under peft's names
        local=parameters,
        gather=(lambda name, owner: gather(name))
        if pipelined
        else lambda name, owner: gathered_to(parameters[name], owner),
        convert=lambda name, full: {peft_key(name, adapter_name): full},
        gathers_to_rank_zero=pipelined,
    )
    staging = make_staging_dir(target, ".adapter-tmp")
    try:
        write_weight_files(staging, spec, f"the LoRA adapter to {target}")
        error = None
        try:
            if is_rank_zero():
                _saved_config(inner, config).save_pretrained(staging)
                _place(staging, target)
        except Exception as exc:
            error = exc
        agree_or_raise(error, f"Writing the LoRA adapter to {target}")
    finally:
        if is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _saved_config(model: nn.Module, config: Any) -> Any:
    """The config as ``PeftModel.save_pretrained`` records it: inference mode, the name the base model was loaded from,
    and (without a task type) the base model's class for peft's auto mapping."""
    saved = copy.deepcopy(config)
    saved.inference_mode = True
    saved.base_model_name_or_path = model.__dict__.get("name_or_path") or saved.base_model_name_or_path
    if saved.task_type is None:
        cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
        saved.auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return saved


def _place(staging: Path, target: Path) -> None:
    """The staged files replace those of the same names in ``target`` (created if needed); its other files stay."""
    target.mkdir(exist_ok=True)
    for path in staging.iterdir():
        os.replace(path, target / path.name)
