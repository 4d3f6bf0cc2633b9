"""``NeMoAutoDiffusionPipeline``: a diffusers pipeline whose selected components are loaded straight into parallelized
modules, under the same topology-ownership rule as the causal-LM auto classes.

The caller supplies one resolved ``MeshContext``. Each component named in ``components_to_load`` is built on the
meta device from its config, parallelized by its class's ``parallelizer`` (default ``ModelParallelizer()``) with
that one context, and filled from its subfolder's weights by the sharded loader (each rank reading only its slices).
diffusers loads the other components as usual and assembles the pipeline around the parallelized ones. ``diffusers``
is an optional extra: ``pip install "automodel[diffusion]"``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from automodel._compat.transformers import build_from_config
from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.parallelizer import parallelizer_for
from automodel.loading.agreement import agree_or_raise
from automodel.loading.meta_build import init_skipped_on_meta
from automodel.loading.pipeline import build_on_every_rank, load_parallelized

from .diffusion_save import DIFFUSERS_WEIGHTS, adopt_collective_save, make_saving_collective

__all__ = ["NeMoAutoDiffusionPipeline"]

INSTALL_HINT = 'pip install "automodel[diffusion]"'
DEFAULT_COMPONENTS = ("transformer",)
logger = logging.getLogger(__name__)


def _require(module_name: str) -> Any:
    """An optional dependency of the diffusion extra (``diffusers``, ``accelerate``), or an ImportError that says how
    to install it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"NeMoAutoDiffusionPipeline needs the optional `{module_name}` dependency, which is not installed: "
            f"{INSTALL_HINT}"
        ) from error


class NeMoAutoDiffusionPipeline:
    """``diffusers.DiffusionPipeline.from_pretrained``, with the selected components loaded parallelized.

    ``from_pretrained`` returns the diffusers pipeline itself (e.g. a ``FluxPipeline``), not a wrapper.
    """

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        mesh_context: MeshContext | None = None,
        components_to_load: Sequence[str] = DEFAULT_COMPONENTS,
        dtype: torch.dtype | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        **pipeline_kwargs: Any,
    ) -> Any:
        """Load the pipeline at ``pretrained_model_name_or_path`` (hub id or local directory) with every component in
        ``components_to_load`` parallelized for ``mesh_context``.

        Without ``mesh_context`` the plain diffusers pipeline is returned. ``dtype`` (or diffusers' own name for it,
        ``torch_dtype``; both only where they agree) is the dtype of every component, or a diffusers dict of them by
        component name (``"default"`` for the others); diffusers' default, float32, when ``None``. ``variant`` and
        ``use_safetensors`` choose the weight files of the parallelized components as diffusers chooses them.
        ``pipeline_kwargs`` go to ``DiffusionPipeline.from_pretrained``.

        With ``mesh_context``, the pipeline's ``save_pretrained`` is collective (call it on every rank): the
        parallelized components are written consolidated, the others by rank 0 with diffusers.
        """
        diffusers = _require("diffusers")
        name_or_path = pretrained_model_name_or_path
        dtype = _agreed_dtype(dtype, pipeline_kwargs.pop("torch_dtype", None))
        variant, use_safetensors = pipeline_kwargs.get("variant"), pipeline_kwargs.get("use_safetensors")
        directory = _resolve_pipeline_dir(
            diffusers, name_or_path, revision, cache_dir, local_files_only, token, variant, use_safetensors
        )
        components = _pipeline_components(diffusers, directory)
        selected = _checked_selection(diffusers, components, components_to_load, name_or_path)
        if dtype is not None:
            pipeline_kwargs["torch_dtype"] = dtype
        if mesh_context is None:
            return diffusers.DiffusionPipeline.from_pretrained(directory, **pipeline_kwargs)
        variants = _component_variants(directory, components, variant)
        for name, component_class in selected.items():
            pipeline_kwargs[name] = _load_parallelized(
                directory / name,
                component_class,
                mesh_context,
                _component_dtype(dtype, name),
                variant=variants.get(name),
                use_safetensors=use_safetensors,
            )
        pipe = diffusers.DiffusionPipeline.from_pretrained(directory, **pipeline_kwargs)
        # diffusers records a component's (library, class) from its runtime class, which FSDP2 / DDP replace with a
        # dynamic subclass (FSDPFluxTransformer2DModel): keep the entries of model_index.json, so the pipeline's
        # config still names the loadable classes.
        pipe.register_to_config(**{name: components[name] for name in selected})
        make_saving_collective(pipe, tuple(selected))
        return pipe


def _agreed_dtype(dtype: Any, torch_dtype: Any) -> Any:
    """``dtype``, or diffusers' ``torch_dtype`` for it; both given, they must be the same."""
    if torch_dtype is None:
        return dtype
    if dtype is not None and dtype != torch_dtype:
        raise ValueError(
            f"dtype={dtype} and torch_dtype={torch_dtype} disagree: torch_dtype is diffusers' name for the same "
            "argument. Pass only one of them."
        )
    return torch_dtype


def _component_dtype(dtype: Any, name: str) -> torch.dtype | None:
    """The dtype of component ``name``: ``dtype`` itself, or its entry in a diffusers dict of dtypes by component
    (``"default"`` for the components it does not name, float32 without one), as diffusers reads it."""
    if isinstance(dtype, dict):
        return dtype.get(name, dtype.get("default", torch.float32))
    return dtype


def _component_variants(directory: Path, components: dict[str, tuple[str, str]], variant: str | None) -> dict:
    """Component name -> ``variant`` for the components whose subfolder holds files of that variant, as diffusers'
    ``DiffusionPipeline.from_pretrained`` decides it (``_identify_model_variants``): a component without them loads
    its plain weight files, and a variant no component has is an error."""
    if variant is None:
        return {}
    found = {}
    for name in components:
        folder = directory / name
        files = os.listdir(folder) if folder.is_dir() else []
        if any(len(parts) > 1 and parts[1].startswith(variant) for parts in (file.split(".") for file in files)):
            found[name] = variant
    if not found:
        raise ValueError(
            f"variant={variant!r}: no component of the pipeline in {directory} has weight files of that variant "
            f"(e.g. {DIFFUSERS_WEIGHTS}.{variant}.safetensors), so diffusers cannot load it either."
        )
    plain = [name for name in components if name not in found]
    if plain:
        logger.info("variant=%r: %s have no files of that variant and load their plain weights.", variant, plain)
    return found


def _resolve_pipeline_dir(
    diffusers: Any,
    name_or_path: str | os.PathLike,
    revision: str | None,
    cache_dir: str | os.PathLike | None,
    local_files_only: bool,
    token: str | bool | None,
    variant: str | None = None,
    use_safetensors: bool | None = None,
) -> Path:
    """A local pipeline directory: ``name_or_path`` itself, or the hub snapshot diffusers downloads, with the files of
    ``variant`` (the hub cache's file locks make concurrent downloads by several ranks safe)."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    directory, error = None, None
    try:
        directory = Path(
            diffusers.DiffusionPipeline.download(
                str(name_or_path),
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
                variant=variant,
                use_safetensors=use_safetensors,
            )
        )
    except Exception as exc:  # raised below on every rank, so that no rank goes on alone into a collective
        error = exc
    agree_or_raise(error, f"Resolving {name_or_path}")
    return directory


def _pipeline_components(diffusers: Any, directory: Path) -> dict[str, tuple[str, str]]:
    """Component name -> ``(library, class name)`` from the pipeline's ``model_index.json`` (null ones left out)."""
    if not (directory / "model_index.json").is_file():
        raise FileNotFoundError(f"{directory} has no model_index.json, so it is not a diffusers pipeline.")
    index = diffusers.DiffusionPipeline.load_config(directory)
    return {
        name: tuple(entry)
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, (list, tuple)) and len(entry) == 2 and None not in entry
    }


def _component_class(diffusers: Any, library: str, class_name: str) -> type:
    """The class ``model_index.json`` names: in a library (diffusers, transformers) or a diffusers pipeline module."""
    module = getattr(diffusers.pipelines, library, None) or importlib.import_module(library)
    return getattr(module, class_name)


def _checked_selection(
    diffusers: Any, components: dict[str, tuple[str, str]], requested: Sequence[str], name_or_path: Any
) -> dict[str, type]:
    """The requested components' classes, each one a torch module of the pipeline."""
    if isinstance(requested, str):
        requested = [requested]
    unknown = [name for name in requested if name not in components]
    if unknown:
        raise ValueError(
            f"components_to_load names {unknown}, which the pipeline {name_or_path} does not have. Its components "
            f"are: {sorted(components)}."
        )
    classes = {name: _component_class(diffusers, *components[name]) for name in requested}
    not_modules = {name: cls.__name__ for name, cls in classes.items() if not issubclass(cls, nn.Module)}
    if not_modules:
        raise ValueError(
            f"components_to_load names {not_modules}, which are not torch modules and cannot be parallelized: "
            "choose among the pipeline's models (transformer, unet, vae, text encoders)."
        )
    return classes


def _load_parallelized(
    subfolder: Path,
    component_class: type,
    mesh_context: MeshContext,
    dtype: torch.dtype | None,
    *,
    variant: str | None = None,
    use_safetensors: bool | None = None,
) -> nn.Module:
    """The shared pipeline (build on meta -> check the checkpoint -> parallelize -> allocate the local shards -> read
    only those) for one component, which must keep its own class (the pipeline calls it by its interface).
    ``variant`` and ``use_safetensors`` choose its weight files (``diffusion_pytorch_model.fp16.safetensors``, or
    the variant's index and shards)."""
    component = build_on_every_rank(
        lambda: _build_on_meta(subfolder, component_class, dtype), f"Building the component {subfolder.name}"
    )
    _use_class_tp_plan(component, parallelizer_for(component), mesh_context)
    loaded = load_parallelized(
        component, mesh_context, checkpoint=subfolder, variant=variant, use_safetensors=use_safetensors
    )
    if not isinstance(loaded.model, component_class):
        raise TypeError(
            f"Parallelizing {subfolder.name} with {type(mesh_context.strategy).__name__} returned a "
            f"{type(loaded.model).__name__} wrapper, but the pipeline needs a {component_class.__name__}: use the "
            "fsdp2 or ddp strategy, which keep the component's own class."
        )
    adopt_collective_save(loaded.model, component_class)
    return loaded.model.eval()


def _use_class_tp_plan(component: nn.Module, parallelizer: ModelParallelizer, mesh_context: MeshContext) -> None:
    """Under TP, give a diffusers component its class's plan in the form the shared TP reads.

    diffusers plans are globs whose one ``*`` stands for a block index, and may name one element of a list
    (``attn.to_out.0``, beside a dropout ``to_out.1``), which transformers' wildcard convention cannot address; they
    are expanded here to exact module names. Plans may also hold diffusers-only style objects (Flux's
    ``PackedRowwiseParallel`` for a fused input of unequal parts), which have no transformers style: a clear error.
    """
    if mesh_context.tp_size == 1 or parallelizer._tp_plan is not None or isinstance(component, PreTrainedModel):
        return
    plan = getattr(component, "_tp_plan", None) or {}
    foreign = {name: type(style).__name__ for name, style in plan.items() if not isinstance(style, str)}
    if foreign:
        raise ValueError(
            f"The tensor-parallel plan of {type(component).__name__} uses diffusers' own styles {foreign}, which have "
            "no transformers style name, so the shared tensor parallelism cannot apply it. Use tp_size=1 (FSDP2 "
            "only) for this component, or give its class a `parallelizer` whose `_tp_plan` uses transformers "
            "style names."
        )
    names = [name for name, _ in component.named_modules()]
    exact: dict[str, str] = {}
    for pattern, style in plan.items():
        glob = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        exact.update(dict.fromkeys((name for name in names if glob.fullmatch(name)), style))
    component._tp_plan = exact


def _build_on_meta(subfolder: Path, component_class: type, dtype: torch.dtype | None) -> nn.Module:
    """The component built from its config with its parameters on the meta device.

    A transformers model is built wholly on meta (its ``_init_weights`` recomputes buffers after loading). A diffusers
    model gets only its parameters on meta, as diffusers' own loader does: its buffers and the plain tensors some
    models compute at construction (e.g. rotary tables) are small and have no other source.
    """
    if issubclass(component_class, PreTrainedModel):
        config = component_class.config_class.from_pretrained(subfolder)
        with torch.device("meta"), init_skipped_on_meta():
            return build_from_config(component_class, config, dtype=dtype or torch.float32)
    if not (hasattr(component_class, "load_config") and hasattr(component_class, "from_config")):
        raise TypeError(
            f"{subfolder.name} is a {component_class.__name__}, neither a transformers model nor a diffusers model "
            "built from a config, so it cannot be loaded parallelized. Leave it out of components_to_load."
        )
    init_empty_weights = _require("accelerate").init_empty_weights
    with init_empty_weights(include_buffers=False):
        component = component_class.from_config(component_class.load_config(subfolder))
    return component.to(dtype) if dtype is not None else component
