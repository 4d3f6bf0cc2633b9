"""``from_pretrained``'s keyword arguments, checked the way a transformers user expects.

transformers' ``from_pretrained`` takes loading options and config attributes in one ``**kwargs``. Here each keyword
is one of: a loading option this library honours (named parameters of ``from_pretrained``), an option that
conflicts with a mesh or is not supported (an error that names it and says why), a config attribute (an override of
``config.json``, as in transformers), or a mistake: a ``TypeError`` naming it, with the close matches. Nothing is
dropped silently.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PretrainedConfig

__all__ = ["check_loading_options", "dtype_argument", "unknown_keywords_error"]

# Options whose job the MeshContext does: where shards live, how the model is parallelized.
_CONFLICTS_WITH_MESH = {
    "device_map": "it places whole modules on devices, while mesh_context decides where each shard lives",
    "max_memory": "it sizes a device_map; with a mesh every rank holds only its own shards",
    "offload_folder": "it offloads the modules a device_map cannot place; use FSDP2Config(cpu_offload=True) instead",
    "offload_buffers": "it offloads buffers with a device_map; use FSDP2Config(cpu_offload=True) instead",
    "device_mesh": "pass mesh_context=MeshContext.from_meshes(device_mesh) instead",
    "distributed_config": "transformers' own parallelism; pass mesh_context=MeshContext.build(...) instead",
    "tp_size": "the TP size is part of the mesh: pass mesh_context=MeshContext.build(tp_size=...) instead",
}
_QUANTIZATION = ("load_in_8bit", "load_in_4bit", "quantization_config")
_UNSUPPORTED = {
    "gguf_file": "GGUF weights are not read here: convert them to safetensors first (tools/convert_smollm2_gguf.py)",
    "state_dict": "weights come from the checkpoint directory, read slice by slice; save the state dict there first",
    "ignore_mismatched_sizes": "a tensor whose shape disagrees with the config is an error; give the config the "
    "checkpoint's sizes, or load the checkpoint as it is and replace the module afterwards",
    "adapter_name": "pass a peft LoraConfig as peft_config",
    "adapter_kwargs": "pass a peft LoraConfig as peft_config",
    "key_mapping": "checkpoint keys are mapped with transformers' own conversion mapping for the architecture",
    "use_kernels": "hub kernels are not loaded here",
    "kernel_config": "hub kernels are not loaded here",
    "allow_all_kernels": "hub kernels are not loaded here",
    "output_loading_info": "rank 0 logs what was loaded; strict=True (the default) refuses missing keys",
    "from_tf": "only PyTorch checkpoints (safetensors or .bin) are read",
    "from_flax": "only PyTorch checkpoints (safetensors or .bin) are read",
    "weights_only": ".bin checkpoints are always unpickled with weights_only=True (tensors only, no code); convert "
    "the checkpoint to safetensors",
    "proxies": "the hub is reached through huggingface_hub's own settings: set HTTPS_PROXY / HTTP_PROXY instead",
    "fusion_config": "the model is built as its class defines it",
    "experts_implementation": "the experts run as the model class (or its sidecar, under expert parallelism) defines "
    "them",
    "tqdm_class": "rank 0 reports the load's progress itself",
    "disable_mmap": "checkpoint files are read with positioned reads into each rank's shards, not memory-mapped",
}
# transformers' defaults of the options above (the value that asks for nothing): a wrapper that always passes them
# (TRL passes device_map=None and quantization_config=None) is not refused. Those not listed default to None.
_OFF_VALUES: dict[str, Any] = {
    "offload_buffers": False,
    "load_in_8bit": False,
    "load_in_4bit": False,
    "ignore_mismatched_sizes": False,
    "adapter_name": "default",
    "adapter_kwargs": {},
    "use_kernels": False,
    "allow_all_kernels": False,
    "output_loading_info": False,
    "from_tf": False,
    "from_flax": False,
    "weights_only": True,
    "disable_mmap": False,
}
# Options transformers' from_pretrained still accepts and ignores (they did something in earlier releases).
_IGNORED_AS_IN_TRANSFORMERS = ("mirror", "_fast_init", "offload_state_dict")
# Honoured: the named parameters of from_pretrained (listed for the close-match suggestions).
LOADING_OPTIONS = (
    "mesh_context",
    "dtype",
    "revision",
    "cache_dir",
    "local_files_only",
    "token",
    "trust_remote_code",
    "attn_implementation",
    "strict",
    "tp_plan",
    "peft_config",
    "torch_dtype",
    "force_download",
    "use_safetensors",
    "subfolder",
    "variant",
    "generation_config",
    "low_cpu_mem_usage",
)


def check_loading_options(kwargs: dict[str, Any], *, with_mesh: bool = True) -> dict[str, Any]:
    """Refuse the keywords that conflict with a mesh (``with_mesh``: whether one was passed) or are not supported,
    unless they hold transformers' default (``None``, ``False``: they ask for nothing); drop those and the ones
    transformers ignores; return the rest, which must be config attributes (checked once the config is read,
    :func:`unknown_keywords_error`)."""
    remaining = {}
    for key, value in kwargs.items():
        if key in _IGNORED_AS_IN_TRANSFORMERS or (key == "low_cpu_mem_usage" and (value is None or value is True)):
            continue
        refused = key in _CONFLICTS_WITH_MESH or key in _QUANTIZATION or key in _UNSUPPORTED
        if refused and _asks_for_nothing(key, value):
            continue
        if key in _CONFLICTS_WITH_MESH and with_mesh:
            raise ValueError(f"from_pretrained({key}=...) cannot be combined with a mesh: {_CONFLICTS_WITH_MESH[key]}.")
        if key in _CONFLICTS_WITH_MESH:
            raise ValueError(
                f"from_pretrained({key}=...) is not supported here: this library places the model itself. Without "
                "mesh_context it loads the whole model on the CPU; to spread it over devices, pass "
                f"mesh_context=MeshContext.build(...) ({_CONFLICTS_WITH_MESH[key]}); for {key} itself, use "
                "transformers' AutoModel classes."
            )
        if key in _QUANTIZATION:
            raise ValueError(
                f"from_pretrained({key}=...) asks to quantize the model while loading, which is not supported: the "
                "parallelized model holds full-precision weights (bf16 or fp32). Load without it, and choose the "
                "precision with dtype=; a checkpoint already quantized with fp8 or mxfp4 is dequantized on read "
                "without any option."
            )
        if key in _UNSUPPORTED:
            raise ValueError(f"from_pretrained({key}=...) is not supported: {_UNSUPPORTED[key]}.")
        if key == "low_cpu_mem_usage":
            raise ValueError(
                f"from_pretrained(low_cpu_mem_usage={value!r}) is not supported: the model is always built on the meta "
                "device and every rank reads only its own shards (low_cpu_mem_usage=True, or leave it out)."
            )
        remaining[key] = value
    return remaining


def _asks_for_nothing(key: str, value: Any) -> bool:
    """Whether ``value`` is transformers' default for the option ``key`` (``None`` always is)."""
    return value is None or (key in _OFF_VALUES and type(value) is type(_OFF_VALUES[key]) and value == _OFF_VALUES[key])


def unknown_keywords_error(unknown: Iterable[str], config: PretrainedConfig) -> TypeError:
    """The error for keywords that are neither loading options nor attributes of ``config``, with close matches."""
    candidates = [*LOADING_OPTIONS, *config.to_dict()]
    hints = []
    for key in unknown:
        matches = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
        hints.append(
            f"{key!r}" + (f" (did you mean {', '.join(repr(match) for match in matches)}?)" if matches else "")
        )
    return TypeError(
        f"from_pretrained got keyword arguments that are neither loading options nor attributes of "
        f"{type(config).__name__}: {', '.join(hints)}."
    )


def dtype_argument(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | str:
    """transformers' rule: ``dtype`` wins over the deprecated ``torch_dtype`` (which warns); neither: ``"auto"``."""
    if torch_dtype is not None:
        warnings.warn("`torch_dtype` is deprecated! Use `dtype` instead!", FutureWarning, stacklevel=3)
    if dtype is not None:
        return dtype
    return torch_dtype if torch_dtype is not None else "auto"
