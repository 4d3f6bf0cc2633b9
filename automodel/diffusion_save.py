"""Saving a diffusers pipeline whose components are parallelized: each parallelized diffusers component gets a
collective ``save_pretrained`` that writes its consolidated checkpoint (every rank its own shards' bytes, through
``automodel.loading.parallel_export``), and the pipeline's ``save_pretrained`` writes those together on every rank and
the other components and ``model_index.json`` with diffusers on rank 0. Used by :mod:`automodel.diffusion`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn
from transformers import PreTrainedModel

from automodel.distributed.parallel_model import ParallelizedModel
from automodel.distributed.runtime import is_rank_zero
from automodel.loading.agreement import agree_or_raise
from automodel.loading.checkpoint_files import with_variant
from automodel.loading.parallel_export import WeightFiles, gathered_to, make_staging_dir, write_weight_files

__all__ = ["CollectiveComponentSave", "adopt_collective_save", "make_saving_collective"]

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"  # diffusers' weight file stem (ModelMixin.save_pretrained)


class CollectiveComponentSave:
    """Mixed into the class of a parallelized diffusers component: ``save_pretrained`` is collective (call it on every
    rank) and writes what diffusers' ``ModelMixin.save_pretrained`` writes for the whole model (its ``config.json``
    naming the diffusers class, ``diffusion_pytorch_model.safetensors`` or shards and their index), every rank writing
    its own shards' bytes (``automodel.loading.parallel_export``). diffusers' own cannot save shards (``DTensor``)."""

    _diffusers_class: type

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        save_function: Any = None,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str = "10GB",
        push_to_hub: bool = False,
        use_flashpack: bool = False,
        **kwargs: Any,
    ) -> None:
        """diffusers' ``save_pretrained``, collective; ``is_main_process`` is not needed (the ranks share the
        writing). The arguments this cannot honour are refused on every rank before anything is written."""
        refused = {
            "save_function": save_function is not None,
            "safe_serialization=False": not safe_serialization,
            "push_to_hub=True": push_to_hub,
            "use_flashpack=True": use_flashpack,
        }
        refused = [name for name, given in refused.items() if given] + sorted(kwargs)
        _write_component(self, Path(save_directory), variant, max_shard_size, refused)


def adopt_collective_save(component: nn.Module, component_class: type) -> None:
    """Give a parallelized diffusers component (a transformers one has ``ParallelizedModel``'s) the subclass of its
    class whose ``save_pretrained`` is collective and consolidated; the class keeps its name."""
    if isinstance(component, (PreTrainedModel, CollectiveComponentSave)):
        return
    cls = type(component)
    component.__class__ = type(
        cls.__name__,
        (CollectiveComponentSave, cls),
        {"__module__": cls.__module__, "_diffusers_class": component_class},
    )


def _write_component(
    component: nn.Module, target: Path, variant: str | None, max_shard_size: int | str, refused: list[str]
) -> None:
    """Collective: the consolidated checkpoint of ``component`` into ``target``, staged beside it and moved in by rank
    0, replacing the weight files of the same variant there (those of other variants stay), as diffusers does."""
    target = target.absolute()
    what = f"Saving {type(component).__name__} to {target}"
    state, stored, split, error = {}, {}, None, None
    try:
        if refused:
            raise ValueError(
                f"save_pretrained of a parallelized {type(component).__name__} does not support {refused}: it writes "
                "safetensors files into a local directory. Upload the folder afterwards from one rank (e.g. with "
                "huggingface_hub.upload_folder)."
            )
        if target.exists() and not target.is_dir():
            raise NotADirectoryError(f"{target} exists and is not a directory: save to a directory.")
        state = dict(component.state_dict())
        stored = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
        pattern = with_variant(f"{DIFFUSERS_WEIGHTS}{{suffix}}.safetensors", variant)
        split = split_torch_state_dict_into_shards(stored, filename_pattern=pattern, max_shard_size=max_shard_size)
    except Exception as exc:  # raised below on every rank, before anything is written
        error = exc
    agree_or_raise(error, what)
    staging = None
    try:
        staging = make_staging_dir(target, ".save-tmp")
        spec = WeightFiles(
            files=dict(split.filename_to_tensors),
            stored=stored,
            source_of={name: name for name in stored},
            direct=set(stored),
            local=state,
            gather=lambda source, owner: gathered_to(state[source], owner),
            convert=lambda source, full: {source: full.detach().cpu()},
        )
        write_weight_files(staging, spec, f"the weights of {target}")
        error = None
        if is_rank_zero():
            try:
                if split.is_sharded:
                    index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
                    index_name = with_variant(f"{DIFFUSERS_WEIGHTS}.safetensors.index.json", variant)
                    (staging / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                config = json.loads(component.to_json_string())
                config["_class_name"] = component._diffusers_class.__name__  # not FSDP's dynamic subclass
                (staging / component.config_name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                _replace_weight_files(staging, target, variant)
                staging = None
            except Exception as exc:
                error = exc
        agree_or_raise(error, what)
    finally:
        if staging is not None and is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)


def _replace_weight_files(staging: Path, target: Path, variant: str | None) -> None:
    """Move the staged files into ``target`` (created if needed), removing its earlier weight files of ``variant``
    first (a stale index or shard would shadow or break the new ones); each file is replaced atomically."""
    target.mkdir(parents=True, exist_ok=True)
    tag = rf"\.{re.escape(variant)}" if variant else ""
    weights = re.compile(
        rf"{DIFFUSERS_WEIGHTS}{tag}(-\d{{5}}-of-\d{{5}})?\.(safetensors|bin)"
        rf"|{DIFFUSERS_WEIGHTS}\.(safetensors|bin)\.index{tag}\.json"
    )
    for stale in target.iterdir():
        if stale.is_file() and weights.fullmatch(stale.name):
            stale.unlink()
    for path in staging.iterdir():
        os.replace(path, target / path.name)
    staging.rmdir()


def make_saving_collective(pipe: Any, parallelized: tuple[str, ...]) -> None:
    """Give the pipeline (itself, its class unchanged) a collective ``save_pretrained`` and refuse ``push_to_hub``."""

    def save_pretrained(
        save_directory: str | os.PathLike,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """diffusers' ``DiffusionPipeline.save_pretrained``, collective: call it on every rank. The parallelized
        components are written consolidated by every rank together, the others and ``model_index.json`` by rank 0
        with diffusers; plain ``DiffusionPipeline.from_pretrained`` loads the result."""
        _save_pipeline(
            pipe, parallelized, Path(save_directory), safe_serialization, variant, max_shard_size, push_to_hub, kwargs
        )

    def push_to_hub(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "push_to_hub of a pipeline with parallelized components would save it on every rank into separate "
            "temporary folders: call pipe.save_pretrained(directory) on every rank, then upload that folder from "
            "one rank (e.g. with huggingface_hub.upload_folder)."
        )

    pipe.save_pretrained = save_pretrained
    pipe.push_to_hub = push_to_hub


def _save_pipeline(
    pipe: Any,
    parallelized: tuple[str, ...],
    directory: Path,
    safe_serialization: bool,
    variant: str | None,
    max_shard_size: int | str | None,
    push_to_hub: bool,
    kwargs: dict[str, Any],
) -> None:
    error = None
    try:
        refused = [
            name
            for name, given in (
                ("safe_serialization=False", not safe_serialization),
                ("push_to_hub=True", push_to_hub),
                ("use_flashpack=True", kwargs.get("use_flashpack", False)),
            )
            if given
        ]
        if refused:
            raise ValueError(
                f"save_pretrained of a pipeline with parallelized components ({list(parallelized)}) does not support "
                f"{refused}: it writes safetensors files into a local directory. Upload the folder afterwards from "
                "one rank (e.g. with huggingface_hub.upload_folder)."
            )
        unsaveable = [
            name
            for name in parallelized
            if not isinstance(getattr(pipe, name), (CollectiveComponentSave, ParallelizedModel))
        ]
        if unsaveable:
            raise TypeError(f"The parallelized components {unsaveable} have no collective save_pretrained.")
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{directory} exists and is not a directory: save to a directory.")
    except Exception as exc:  # raised below on every rank, before anything is written
        error = exc
    agree_or_raise(error, f"Saving the pipeline to {directory}")
    shard_size = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    for name in parallelized:
        getattr(pipe, name).save_pretrained(directory / name, variant=variant, **shard_size)
    error = None
    if is_rank_zero():
        try:
            with _saved_elsewhere(pipe, parallelized):
                type(pipe).save_pretrained(
                    pipe,
                    directory,
                    safe_serialization=safe_serialization,
                    variant=variant,
                    max_shard_size=max_shard_size,
                    **kwargs,
                )
        except Exception as exc:
            error = exc
    agree_or_raise(error, f"Saving the pipeline's other components to {directory}")


@contextlib.contextmanager
def _saved_elsewhere(pipe: Any, names: tuple[str, ...]) -> Iterator[None]:
    """diffusers' pipeline ``save_pretrained`` (on rank 0 alone) skipping the components ``names``, which the ranks
    have written together: their ``save_pretrained`` does nothing meanwhile."""

    def already_saved(save_directory: Any) -> None:
        return None

    components = [getattr(pipe, name) for name in names]
    for component in components:
        component.save_pretrained = already_saved
    try:
        yield
    finally:
        for component in components:
            del component.save_pretrained
