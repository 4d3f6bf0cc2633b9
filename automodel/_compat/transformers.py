"""Every private transformers symbol automodel uses, imported once (see :mod:`automodel._compat`).

transformers documents its top-level names and the model classes; the modules below (``transformers.distributed``'s
internals, ``core_model_loading``, ``conversion_mapping``, ``modeling_utils`` helpers, ``integrations``) and the
``_``-prefixed methods are internals that change between releases. "Known" gives the releases a symbol was checked in: from the oldest
release checked (5.0.0) or the one it appeared in, to the newest tested one. The tested range is
``TESTED_RANGES["transformers"]`` (5.23.0 to 5.24.0). It starts at 5.23: in 5.22 the Gemma 4 and DiffusionGemma
configs still route experts with the ``ep_router`` / ``moe_tp_experts`` plan rather than the ``ep_dispatch_experts``
all-to-all style the EP path builds on (and the plan helpers lived in ``tensor_parallel``, the EP dispatch had no
``ep_implementation``); before 5.22 ``transformers.distributed`` had no expert parallelism at all.

Not wrapped, on purpose: the attributes a model class declares for transformers (``_no_split_modules``, ``_tp_plan``,
``_keep_in_fp32_modules(_strict)``, ``_keys_to_ignore_on_*``, ``_tied_weights_keys``) and its ``_init_weights``
hook. They are the model-author conventions transformers documents for adding a model, which the sidecars declare too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .versions import private_symbol

__all__ = [
    "ForCausalLMLoss",
    "ALL_PARALLEL_STYLES",
    "CACHE_ARGUMENTS",
    "AllReduceParallel",
    "ColwiseParallel",
    "Concatenate",
    "EmbeddingParallel",
    "EpDispatchExpertsParallel",
    "MergeModulelist",
    "MlaKvAProjParallel",
    "PackedColwiseParallel",
    "ReplicatedWithGradAllReduce",
    "RowwiseParallel",
    "SequenceParallel",
    "TensorParallelLayer",
    "WeightConverter",
    "WeightRenaming",
    "all_reduce_backward",
    "all_reduce_forward",
    "build_from_config",
    "build_glob_alternation",
    "convert_moe_packed_tensors",
    "dot_natural_key",
    "dtype_plan",
    "get_model_conversion_mapping",
    "get_parameter_plan",
    "guard_torch_init_functions",
    "local_dtensor_params",
    "mark_initialized",
    "remove_tied_weights_from_state_dict",
    "rename_source_key",
    "replace_layer_number_by_wildcard",
    "revert_weight_conversion",
]


def _transformers(*paths: str, purpose: str) -> Any:
    return private_symbol("transformers", *paths, purpose=purpose)


_PARALLEL_UTILS = "transformers.distributed.parallel_utils"
_TENSOR_PARALLEL = "transformers.distributed.tensor_parallel"
_CORE_LOADING = "transformers.core_model_loading"

# --- Pipeline parallelism (automodel.distributed.pipeline_stages) ------------------------------------------------------

# The causal-LM loss a model's `self.loss_function` resolves to (labels shifted by one inside): a pipelined model's
# `train_step` computes the same loss per microbatch. Known: 4.46.0 - 5.24.0.
ForCausalLMLoss = _transformers("transformers.loss.loss_utils.ForCausalLMLoss", purpose="the pipelined causal-LM loss")

# --- Tensor and expert parallelism (automodel.distributed.hf_plans, tp_styles) ---------------------------------------

# transformers' named TP styles ("colwise", "rowwise", "packed_colwise", ...), which the models' plans use.
# Known: 5.22.0 - 5.24.0 (before 5.22: transformers.integrations.tensor_parallel, another API).
ALL_PARALLEL_STYLES = _transformers(f"{_PARALLEL_UTILS}.ALL_PARALLEL_STYLES", purpose="resolving TP plan style names")
# The TP style classes automodel installs, subclasses and corrects (tp_styles). Known: 5.16.0 - 5.24.0
# (EmbeddingParallel: 5.21.0 - 5.24.0).
AllReduceParallel = _transformers(f"{_TENSOR_PARALLEL}.AllReduceParallel", purpose="the 'all_reduce' TP style")
ColwiseParallel = _transformers(f"{_TENSOR_PARALLEL}.ColwiseParallel", purpose="the 'colwise' TP style")
EmbeddingParallel = _transformers(f"{_TENSOR_PARALLEL}.EmbeddingParallel", purpose="the 'embedding_rowwise' TP style")
MlaKvAProjParallel = _transformers(f"{_TENSOR_PARALLEL}.MlaKvAProjParallel", purpose="the MLA kv_a_proj TP style")
PackedColwiseParallel = _transformers(f"{_TENSOR_PARALLEL}.PackedColwiseParallel", purpose="'packed_colwise' TP")
ReplicatedWithGradAllReduce = _transformers(
    f"{_TENSOR_PARALLEL}.ReplicatedWithGradAllReduce", purpose="replicated TP modules with summed gradients"
)
RowwiseParallel = _transformers(f"{_TENSOR_PARALLEL}.RowwiseParallel", purpose="the 'rowwise' TP style")
SequenceParallel = _transformers(f"{_TENSOR_PARALLEL}.SequenceParallel", purpose="the 'sequence_parallel' TP style")
TensorParallelLayer = _transformers(f"{_TENSOR_PARALLEL}.TensorParallelLayer", purpose="the base of every TP style")
# The all-to-all expert dispatch style of the models' EP plans; installed with ep_implementation="all_to_all".
# Known: 5.22.0 - 5.24.0 (ep_implementation since 5.23).
EpDispatchExpertsParallel = _transformers(
    "transformers.distributed.expert_parallel.EpDispatchExpertsParallel", purpose="expert parallelism"
)


# Identity forward / summed backward, and summed forward / identity backward, over a process group (the autograd
# functions behind the TP styles' partial sums). Known: 5.22.0 - 5.24.0.
all_reduce_backward = _transformers(f"{_PARALLEL_UTILS}._AllReduceBackward", purpose="TP gradient sums").apply
all_reduce_forward = _transformers(f"{_PARALLEL_UTILS}._AllReduceForward", purpose="TP partial-output sums").apply
# Context that runs a module's forward with its DTensor parameters swapped for their local shards.
# Known: 5.22.0 - 5.24.0.
local_dtensor_params = _transformers(
    f"{_PARALLEL_UTILS}._use_local_dtensor_params", purpose="running TP modules on local shards"
)
# Plan lookup: the style a plan gives a parameter or module name, and a name with its layer numbers as wildcards.
# Known: 5.23.0 - 5.24.0 (5.22 had both in tensor_parallel).
get_parameter_plan = _transformers(f"{_PARALLEL_UTILS}._get_parameter_plan", purpose="TP plan lookup")
replace_layer_number_by_wildcard = _transformers(
    f"{_PARALLEL_UTILS}.replace_layer_number_by_wildcard", purpose="matching TP plan keys"
)

# --- Model-code conventions (automodel.distributed.activation_checkpointing) ------------------------------------------

# The keyword names transformers' layers, attention and mixer modules take their cache under; a checkpointed module
# runs without it. Shim: Mamba mixers (Nemotron-H ...) called it ``cache_params`` until 5.24 renamed it ``cache``.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")

# --- Checkpoint conversion mapping (automodel.loading.key_mapping, export; auto_model) --------------------------------

# The model's renamings and weight converters (legacy keys, per-expert tensors merged into fused experts), applied to
# the checkpoint's key list so that each rank reads only its slices. Known: 5.0.0 - 5.24.0.
get_model_conversion_mapping = _transformers(
    "transformers.conversion_mapping.get_model_conversion_mapping", purpose="checkpoint key conversion"
)
Concatenate = _transformers(f"{_CORE_LOADING}.Concatenate", purpose="describing concatenated checkpoint tensors")
MergeModulelist = _transformers(f"{_CORE_LOADING}.MergeModulelist", purpose="describing stacked expert tensors")
WeightConverter = _transformers(f"{_CORE_LOADING}.WeightConverter", purpose="checkpoint key conversion")
WeightRenaming = _transformers(f"{_CORE_LOADING}.WeightRenaming", purpose="checkpoint key renaming")
dot_natural_key = _transformers(f"{_CORE_LOADING}.dot_natural_key", purpose="ordering checkpoint keys")
rename_source_key = _transformers(f"{_CORE_LOADING}.rename_source_key", purpose="checkpoint key renaming")
# The inverse conversion, for writing checkpoints in the original layout. Known: 5.0.0 - 5.24.0.
revert_weight_conversion = _transformers(
    f"{_CORE_LOADING}.revert_weight_conversion", purpose="saving checkpoints in the original key layout"
)
# One regex alternation over glob patterns (the keys of a dtype plan). Known: 5.0.0 - 5.24.0.
build_glob_alternation = _transformers(f"{_CORE_LOADING}.build_glob_alternation", purpose="matching dtype plans")

# --- Quantized checkpoints (automodel.loading.quantized) ------------------------------------------------------------

# gpt-oss MXFP4 dequantization (E2M1 code pairs and E8M0 group scales to floats); its math is applied to each rank's
# slices. Known: 5.20.0 - 5.24.0.
convert_moe_packed_tensors = _transformers(
    "transformers.integrations.mxfp4.convert_moe_packed_tensors", purpose="dequantizing MXFP4 checkpoints"
)

# --- Tied weights and initialisation (automodel.loading.export, initialization; auto_model; diffusion) ----------------

# Drops the tied copies from a state dict before saving, as save_pretrained does. Known: 5.0.0 - 5.24.0.
remove_tied_weights_from_state_dict = _transformers(
    "transformers.modeling_utils.remove_tied_weights_from_state_dict", purpose="saving models with tied weights"
)


# Context in which torch.nn.init functions skip tensors flagged ``_is_hf_initialized`` (see mark_initialized), as
# transformers' own initialisation runs ``_init_weights``. Known: 5.0.0 - 5.24.0.
guard_torch_init_functions = _transformers(
    "transformers.initialization.guard_torch_init_functions", purpose="initialising only what a checkpoint lacks"
)


def dtype_plan(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The parameters ``_keep_in_fp32_modules(_strict)`` keeps in fp32 at ``dtype``, as glob patterns
    (``PreTrainedModel._get_dtype_plan``). Known: 5.5.0 - 5.24.0."""
    return model._get_dtype_plan(dtype)


def build_from_config(model_class: type, config: Any, **kwargs: Any) -> nn.Module:
    """An instance of ``model_class`` built from ``config`` (``PreTrainedModel._from_config``: no auto-class lookup,
    so a sidecar's own class is built). Known: 5.0.0 - 5.24.0."""
    return model_class._from_config(config, **kwargs)


def mark_initialized(tensor: torch.Tensor) -> None:
    """Flag ``tensor`` so that transformers' ``_init_weights`` leaves it alone (``_is_hf_initialized``).
    Known: 5.0.0 - 5.24.0."""
    tensor._is_hf_initialized = True
