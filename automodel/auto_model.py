"""The auto classes: resolve -> build on meta -> parallelize -> load only the local shards (the shared pipeline of
``automodel.loading.pipeline``)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from automodel._compat.transformers import build_from_config, build_glob_alternation, dtype_plan
from automodel.distributed import MeshContext
from automodel.distributed.runtime import log_rank_zero
from automodel.distributed.tensor_parallel import set_user_tp_plan
from automodel.keyword_arguments import check_loading_options, dtype_argument, unknown_keywords_error
from automodel.loading import CheckpointPlan, read_json, resolve_checkpoint_dir, stored_dtype
from automodel.loading.hub import HubOptions, resolve_adapter_dir, resolve_config_dir
from automodel.loading.meta_build import init_skipped_on_meta
from automodel.loading.pipeline import (
    build_on_every_rank,
    garbage_collection_paused,
    load_parallelized,
    transformers_model,
)
from automodel.loading.quantized import QuantizationScheme, pop_quantization_scheme
from automodel.lora import add_lora
from automodel.lora_checkpoint import LoraAdapter, read_lora_adapter
from model_sidecars import sidecar_class

__all__ = [
    "NeMoAutoModel",
    "NeMoAutoModelForCausalLM",
    "NeMoAutoModelForImageTextToText",
    "NeMoAutoModelForSequenceClassification",
]

logger = logging.getLogger(__name__)

InitMode = Literal["per_module", "exact"]
INIT_MODES: tuple[str, ...] = ("per_module", "exact")


class _NeMoAutoBase:
    """Shared implementation; subclasses name the transformers auto class they mirror."""

    _auto_class: ClassVar[type]
    #: The auto class's mapping from config classes to model classes (transformers' public ``MODEL_*_MAPPING``).
    _auto_mapping: ClassVar[Any]

    @classmethod
    @garbage_collection_paused()
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        mesh_context: MeshContext | None = None,
        config: PretrainedConfig | str | os.PathLike | None = None,
        dtype: torch.dtype | str | dict[str, torch.dtype | str] | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        strict: bool = True,
        tp_plan: dict[str, str] | str | None = None,
        peft_config: Any = None,
        lora_adapter: str | os.PathLike | None = None,
        torch_dtype: torch.dtype | str | None = None,
        force_download: bool = False,
        use_safetensors: bool | None = None,
        subfolder: str = "",
        variant: str | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Load a checkpoint (hub id or local directory) straight into a model parallelized for ``mesh_context``.

        The same model ``transformers``' ``from_pretrained`` returns (same class, modules and numerics, in eval
        mode), with every rank holding and reading only its own shards. ``mesh_context=None`` loads it whole on
        the CPU. ``strict=False`` initialises missing tensors and ignores unexpected ones instead of raising.
        ``tp_plan`` replaces the tensor-parallel plan (transformers style names, full module names with ``*`` for
        layer numbers; ``"auto"``: the model's own), e.g. to shard only the MLPs of a model whose heads do not divide
        ``tp_size``; it takes precedence over a sidecar's plan, and a rule that matches nothing is an error.
        ``peft_config`` (a ``peft.LoraConfig``) adds LoRA adapters before parallelization, on every layout (see
        ``automodel.lora``): only they are trainable, initialised as peft does. ``lora_adapter`` (a folder or hub id
        ``PeftModel.save_pretrained`` / ``automodel.lora_checkpoint.save_lora_adapter`` wrote) adds that adapter
        instead, each rank reading its slices of the factors. A checkpoint quantized with block-scaled FP8 or MXFP4
        (``quant_method`` ``fp8`` / ``mxfp4`` in its config) is dequantized to ``dtype`` while it is read, each rank
        reading the codes and scales of its own shards; other methods are refused (see ``automodel.loading.quantized``).

        ``config`` (a config object, or the folder or hub id of one) replaces the checkpoint's ``config.json``, as in
        transformers; keyword overrides apply on top of (a copy of) it.

        ``dtype`` (``"auto"`` by default: the config's, else the checkpoint's), ``revision``, ``cache_dir``,
        ``local_files_only``, ``token``, ``trust_remote_code``, ``attn_implementation``, ``force_download``,
        ``use_safetensors``, ``subfolder``, ``variant`` and ``generation_config`` mean what they mean in transformers; ``dtype`` wins over the deprecated
        ``torch_dtype``. Other keywords override attributes of the config, as in transformers; one that is not an
        attribute is a ``TypeError`` naming it. Options a mesh replaces (``device_map``, ``max_memory``, ...) and
        quantization while loading (``load_in_8bit``, ``quantization_config``) are refused with the reason.
        """
        dtype = dtype_argument(dtype, torch_dtype)
        config_overrides = check_loading_options(kwargs, with_mesh=mesh_context is not None)
        hub = HubOptions(
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            trust_remote_code=trust_remote_code,
            force_download=force_download,
            subfolder=subfolder,
            use_safetensors=use_safetensors,
            variant=variant,
        )
        name_or_path = pretrained_model_name_or_path
        directory = resolve_checkpoint_dir(name_or_path, hub)

        quantization: list[QuantizationScheme | None] = [None]

        def build() -> nn.Module:
            model_config = load_config(name_or_path, directory, trust_remote_code, config_overrides, config, hub)
            # A quantized checkpoint builds the unquantized model; its weights are dequantized while they are read.
            quantization[0] = pop_quantization_scheme(model_config)
            model_dtype = _resolve_dtype(
                dtype, model_config, lambda: stored_dtype(directory, use_safetensors=use_safetensors, variant=variant)
            )
            model = cls._build_on_meta(model_config, model_dtype, attn_implementation, trust_remote_code)
            if hasattr(model, "generation_config"):
                model.generation_config = generation_config or _generation_config(directory, model)
            return model

        model = build_on_every_rank(build, f"Building the model of {name_or_path}")
        set_user_tp_plan(model, tp_plan)
        if quantization[0] is not None:
            log_rank_zero(
                logger,
                "%s is quantized (%s): dequantizing its weights to %s while reading them.",
                name_or_path,
                quantization[0].describe(),
                next(model.parameters()).dtype,
            )

        adapter = _read_adapter(lora_adapter, peft_config, hub)

        def prepare(model: nn.Module, plan: CheckpointPlan | None) -> None:
            if adapter is not None:
                sources = add_lora(model, adapter.config, mesh_context, plan.keys.sources, adapter=adapter)
                plan.keys.sources = sources
            elif peft_config is not None:
                plan.keys.sources = add_lora(model, peft_config, mesh_context, plan.keys.sources)

        try:
            loaded = load_parallelized(
                model,
                mesh_context,
                checkpoint=directory,
                strict=strict,
                prepare=prepare,
                progress=True,
                use_safetensors=use_safetensors,
                variant=variant,
                quantization=quantization[0],
            )
        finally:
            if adapter is not None:
                adapter.files.close()
        inner = transformers_model(loaded.model)
        log_rank_zero(logger, "%s from %s: %s", type(inner).__name__, directory, loaded.report.summary())
        inner.name_or_path = str(name_or_path)
        return loaded.model.eval()

    @classmethod
    @garbage_collection_paused()
    def from_config(
        cls,
        config: PretrainedConfig,
        *,
        mesh_context: MeshContext | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        init: InitMode = "per_module",
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        tp_plan: dict[str, str] | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
    ) -> nn.Module:
        """A freshly initialised model for pretraining, parallelized for ``mesh_context``.

        ``init="per_module"`` (the default, memory-bounded): the model is built on the meta device, parallelized, its
        local shards allocated, and then initialised module by module with the model's own ``_init_weights`` (so
        with transformers' init distributions): each module gets a full-size temporary of its own tensors, drawn
        from the CPU generator seeded with ``(seed, module name)``, copies its local slices into the shards and
        frees it. The weights are identical (as ``full_tensor()``) on every layout and world size, ``mesh_context=None``
        included; peak host memory is the local shards plus the largest single module.

        ``init="exact"`` (small models, tests): the weights equal, bit for bit, what plain transformers builds after
        ``torch.manual_seed(seed)``. To reproduce transformers' RNG stream each rank initialises the full model on
        the CPU once, keeps its shards and frees the rest: peak host memory is one full copy per rank.
        """
        if init not in INIT_MODES:
            raise ValueError(f"init={init!r} is not an init mode: use one of {list(INIT_MODES)}.")
        dtype = _resolve_dtype(dtype_argument(dtype, torch_dtype), config)
        if init == "exact":
            return cls._from_config_exact(
                config, mesh_context, dtype, seed, attn_implementation, trust_remote_code, tp_plan
            )
        model = build_on_every_rank(
            lambda: cls._build_on_meta(config, dtype, attn_implementation, trust_remote_code),
            f"Building the model of {type(config).__name__}",
        )
        set_user_tp_plan(model, tp_plan)
        loaded = load_parallelized(model, mesh_context, init_seed=seed)
        report = loaded.report
        log_rank_zero(
            logger,
            "%s from its config: initialised %d tensors module by module (seed %d) in %.2f s, peak host memory %.2f GiB",
            type(model).__name__,
            len(report.initialized),
            seed,
            report.seconds,
            report.peak_rss_bytes / 2**30,
        )
        return loaded.model

    @classmethod
    def _from_config_exact(
        cls,
        config: PretrainedConfig,
        mesh_context: MeshContext | None,
        dtype: torch.dtype,
        seed: int,
        attn_implementation: str | None,
        trust_remote_code: bool,
        tp_plan: dict[str, str] | str | None,
    ) -> nn.Module:
        """``from_config(init="exact")``: plain transformers' model after ``torch.manual_seed(seed)``, sharded."""
        kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model_class = cls._model_class(config)
        torch.manual_seed(seed)
        if model_class is not None:
            kwargs.pop("trust_remote_code")
            reference = build_from_config(model_class, config, **kwargs)
        else:
            reference = cls._auto_class.from_config(config, **kwargs)
        _keep_in_fp32(reference, dtype)
        if mesh_context is None:
            return reference
        model = build_on_every_rank(
            lambda: cls._build_on_meta(config, dtype, attn_implementation, trust_remote_code),
            f"Building the model of {type(config).__name__}",
        )
        set_user_tp_plan(model, tp_plan)
        weights = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        loaded = load_parallelized(model, mesh_context, weights=weights)
        del reference, weights
        return loaded.model

    @classmethod
    def _build_on_meta(
        cls, config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str | None, trust_remote_code: bool
    ) -> nn.Module:
        """The model class for ``config`` (its sidecar class when one is registered), on the meta device."""
        kwargs: dict[str, Any] = {"dtype": dtype}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model_class = cls._model_class(config)
        with torch.device("meta"), init_skipped_on_meta():
            if model_class is not None:
                model = build_from_config(model_class, config, **kwargs)
            else:
                model = cls._auto_class.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
        _keep_in_fp32(model, dtype)
        return model

    @classmethod
    def _model_class(cls, config: PretrainedConfig) -> type | None:
        """The class to build instead of the auto class's choice (``None``: the auto class chooses): the sidecar
        class registered for the config's architecture; else, where the auto class has no entry for the config's
        class, the transformers class the config names in ``architectures`` (a sub-model's config: Emu3ForCausalLM
        saves an Emu3TextConfig, which plain transformers' auto class cannot map back to a model)."""
        sidecar = _registered_class(config)
        if sidecar is not None or type(config) in cls._auto_mapping:
            return sidecar
        for name in getattr(config, "architectures", None) or []:
            candidate = getattr(transformers, name, None)
            if isinstance(candidate, type) and issubclass(candidate, PreTrainedModel):
                if isinstance(config, candidate.config_class):
                    return candidate
        return None


def _registered_class(config: PretrainedConfig) -> type | None:
    """The sidecar model class registered for the config's architecture, or ``None``."""
    architecture = (getattr(config, "architectures", None) or [None])[0]
    return sidecar_class(architecture) if architecture else None


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers' ``_keep_in_fp32_modules`` (fp16) / ``_keep_in_fp32_modules_strict`` (fp16 and bf16) convention:
    ``from_pretrained`` applies it while loading weights, but construction (``from_config``) does not, so the meta
    model gets it here, as plain transformers' loaded model has it."""
    plan = dtype_plan(model, dtype) if isinstance(model, PreTrainedModel) else {}
    if not plan:
        return
    pattern, _, _ = build_glob_alternation(list(plan))
    for name, param in model.named_parameters():
        if pattern.search(name) and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


class NeMoAutoModelForCausalLM(_NeMoAutoBase):
    """``transformers.AutoModelForCausalLM``, loaded straight into a parallelized model."""

    _auto_class = AutoModelForCausalLM
    _auto_mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING


class NeMoAutoModel(_NeMoAutoBase):
    """``transformers.AutoModel`` (models without a causal-LM head), loaded straight into a parallelized model."""

    _auto_class = AutoModel
    _auto_mapping = transformers.MODEL_MAPPING


class NeMoAutoModelForImageTextToText(_NeMoAutoBase):
    """``transformers.AutoModelForImageTextToText`` (vision-language models: Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA,
    Mistral 3, Idefics3 / SmolVLM, InternVL ...), loaded straight into a parallelized model.

    The default parallelizer handles both towers without model names (see ``docs/vlm.md``): the decoder layers and
    the vision encoder blocks are FSDP / activation-checkpointing units, TP applies the language model's plan and
    keeps the vision tower replicated over ``tp``, sequence parallelism runs inside each language decoder layer, and
    context parallelism is refused, with the reason.
    Checkpoints with older multimodal key layouts (``language_model.model.*`` ...) load through transformers'
    checkpoint conversion mapping, slice by slice.
    """

    _auto_class = AutoModelForImageTextToText
    _auto_mapping = transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


class NeMoAutoModelForSequenceClassification(_NeMoAutoBase):
    """``transformers.AutoModelForSequenceClassification`` (classifiers and reward models), loaded straight into a
    parallelized model. Its ``score`` head follows the model's TP plan where the plan names it, and is otherwise a
    replicated parameter of the ``tp`` mesh (it computes on the whole hidden state, so its gradient is complete on
    every TP rank)."""

    _auto_class = AutoModelForSequenceClassification
    _auto_mapping = transformers.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING


def _resolve_dtype(
    dtype: torch.dtype | str | dict[str, torch.dtype | str],
    config: PretrainedConfig,
    stored: Callable[[], torch.dtype | None] | None = None,
) -> torch.dtype:
    """transformers' rule. ``"auto"``: the dtype the config records, else the checkpoint's (``stored()``: that of its
    first floating-point tensor), else float32. A dict (transformers' deprecated per-sub-config dtypes) gives its
    ``""`` entry to the whole model, with transformers' warning."""
    if isinstance(dtype, dict):
        main = dtype.get("", torch.get_default_dtype())
        warnings.warn(
            "Using different dtypes per module is deprecated and will be removed in future versions; setting "
            f"dtype={main} for all modules.",
            FutureWarning,
            stacklevel=3,
        )
        dtype = main
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # ``dtype`` only: transformers 5 reads an old config's ``torch_dtype`` into it, and the old name is a property
        # that warns it is deprecated (a warning about a keyword the user never passed).
        recorded = getattr(config, "dtype", None)
        if isinstance(recorded, str):
            recorded = getattr(torch, recorded, None)
        if not isinstance(recorded, torch.dtype) and stored is not None:
            recorded = stored()
        return recorded if isinstance(recorded, torch.dtype) else torch.float32
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype: use e.g. torch.bfloat16, 'bfloat16' or 'auto'.")
    return resolved


def load_config(
    name_or_path: str | os.PathLike,
    directory: Path,
    trust_remote_code: bool,
    overrides: dict[str, Any],
    config: PretrainedConfig | str | os.PathLike | None = None,
    hub: HubOptions | None = None,
) -> PretrainedConfig:
    """The model's config with ``overrides`` applied (a keyword that is not a config attribute is an error): the
    checkpoint's ``config.json`` in ``directory`` (of ``name_or_path``), or what ``config`` gives instead, as in
    transformers: a copy of a config object, or the config of another folder or hub id (fetched with ``hub``'s
    options). The model's ``name_or_path`` is ``name_or_path``, as transformers records it."""
    if isinstance(config, PretrainedConfig):
        loaded = copy.deepcopy(config)
        unused = {key: value for key, value in overrides.items() if not hasattr(loaded, key)}
        for key, value in overrides.items():
            if key not in unused:
                setattr(loaded, key, value)
    else:
        source, where = (name_or_path, directory) if config is None else (config, resolve_config_dir(config, hub))
        loaded, unused = _config_in(source, where, trust_remote_code, overrides)
    if unused:
        raise unknown_keywords_error(unused, loaded)
    loaded.name_or_path = str(name_or_path)
    return loaded


def _config_in(
    name_or_path: str | os.PathLike, directory: Path, trust_remote_code: bool, overrides: dict[str, Any]
) -> tuple[PretrainedConfig, dict[str, Any]]:
    """The ``config.json`` in ``directory`` with ``overrides`` applied, and the overrides it has no attribute for."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json, so {name_or_path} is not a transformers checkpoint.")
    raw = read_json(config_file)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        if "auto_map" not in raw:
            raise ValueError(
                f"transformers {transformers.__version__} does not know the architecture of {name_or_path} "
                f"(model_type={model_type!r}, architectures={raw.get('architectures')}). Upgrade transformers, or use a "
                "checkpoint that ships its own modeling code."
            )
        if not trust_remote_code:
            raise ValueError(
                f"{name_or_path} (model_type={model_type!r}) ships its own modeling code, and loading it runs that "
                "code. Pass trust_remote_code=True if you trust it."
            )
    return AutoConfig.from_pretrained(
        directory, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **overrides
    )


def _read_adapter(lora_adapter: Any, peft_config: Any, hub: HubOptions) -> LoraAdapter | None:
    """The peft adapter ``lora_adapter`` names, opened on every rank (its config replaces ``peft_config``)."""
    if lora_adapter is None:
        return None
    if peft_config is not None:
        raise ValueError("Pass peft_config= (new adapters) or lora_adapter= (a saved one), not both.")
    directory = resolve_adapter_dir(lora_adapter, dataclasses.replace(hub, subfolder=""))
    return build_on_every_rank(lambda: read_lora_adapter(directory), f"Reading the LoRA adapter {lora_adapter}")


def _generation_config(directory: Path, model: nn.Module) -> GenerationConfig:
    """The checkpoint's generation config (a damaged file is reported with its path), else the model's default."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return model.generation_config
    read_json(path)
    return GenerationConfig.from_pretrained(directory)
