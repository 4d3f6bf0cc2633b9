"""The one loading pipeline, shared by the auto classes (``from_pretrained``, ``from_config``) and by
``NeMoAutoDiffusionPipeline``'s components:

    build on meta -> check the checkpoint -> prepare -> parallelize -> materialize the local shards -> fill them

where "fill" reads a checkpoint, copies from full in-memory weights, or initialises every module in place (seeded
per module, ``from_config``'s default).

Every step that can fail on one rank only (building, checking, reading) is agreed on by every rank before the next
collective, so a failure is raised everywhere with its own exception class instead of leaving ranks waiting.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from automodel.distributed import MeshContext
from automodel.distributed.megatron_fsdp import install_loaded_weights
from automodel.distributed.parallelizer import parallelizer_for
from automodel.distributed.runtime import device_of

from .agreement import agree_or_raise
from .fill import fill_from_weights, initialize_all
from .initialization import non_persistent_buffer_names
from .loader import CheckpointPlan, load_checkpoint, materialize, plan_checkpoint
from .pipeline_stages import load_pipeline_stages
from .quantized import QuantizationScheme
from .sharded_loader import Loaded

__all__ = ["Loaded", "build_on_every_rank", "garbage_collection_paused", "load_parallelized", "transformers_model"]

Prepare = Callable[[nn.Module, CheckpointPlan | None], None]


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, and back as it was after it (also a decorator).

    A load makes hundreds of thousands of objects (modules, parameters, DTensor specs), and each time their count
    passes the collector's threshold it walks the young ones, now and then all of them: 2-14 ms of a 1.2 GB Llama's
    load on one rank (measured). What a load frees it frees by reference count; cycles it leaves are collected after.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_on_every_rank(build: Callable[[], nn.Module], what: str) -> nn.Module:
    """``build()``, with a failure on any rank raised on every rank (no rank goes on alone into a collective)."""
    model, error = None, None
    try:
        model = build()
    except Exception as exc:  # raised below on every rank, with its own class
        error = exc
    agree_or_raise(error, what)
    return model


def load_parallelized(
    model: nn.Module,
    mesh_context: MeshContext | None,
    *,
    checkpoint: Path | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    init_seed: int | None = None,
    strict: bool = True,
    prepare: Prepare | None = None,
    progress: bool = False,
    use_safetensors: bool | None = None,
    variant: str | None = None,
    quantization: QuantizationScheme | None = None,
) -> Loaded:
    """Turn ``model`` (built on the meta device) into a parallelized model holding its weights.

    The weights come from the ``checkpoint`` directory (each rank reading only the slices of its shards; checked
    against the model first, with ``strict`` key matching; ``use_safetensors`` and ``variant`` choose its files) or from
    full in-memory ``weights`` by name (``from_config(init="exact")`` copies each rank's shards out of them), or are
    drawn by the model's own ``_init_weights`` module by module, seeded from ``(init_seed, module name)`` (see
    ``initialization``: the same weights on every layout, peak host memory the local shards plus one module). A
    checkpoint quantized as ``quantization`` says is dequantized while it is read. ``prepare(model, plan)`` runs after
    the check and before parallelization (LoRA injection). Without ``mesh_context`` the model is filled whole on the
    CPU.
    """
    if sum(source is not None for source in (checkpoint, weights, init_seed)) != 1:
        raise ValueError("load_parallelized needs exactly one of `checkpoint`, `weights` and `init_seed`.")
    plan = None
    if checkpoint is not None:
        plan = plan_checkpoint(
            model,
            checkpoint,
            strict=strict,
            use_safetensors=use_safetensors,
            variant=variant,
            quantization=quantization,
        )
    if prepare is not None:
        prepare(model, plan)
    _record_conversions(model, plan)
    if mesh_context is not None and mesh_context.pipeline is not None:
        return load_pipeline_stages(model, mesh_context, plan, weights, init_seed, progress)
    if mesh_context is not None:
        model = parallelizer_for(model).parallelize(model, mesh_context)
    allocated = materialize(model, device_of(mesh_context))
    inner = transformers_model(model)
    _record_conversions(inner, plan)  # also on a model the parallelizer built anew
    if inner is not model:  # Megatron-FSDP's wrapper names the model's tensors under `module.`
        allocated = {name.removeprefix("module.") for name in allocated}
    # Tensors the build computed for real (a diffusers model's buffers) are kept; those it left on meta are read or
    # computed again, as transformers does after a meta-device build.
    if plan is not None:
        report = load_checkpoint(inner, plan, progress=progress, allocated=allocated)
    elif weights is not None:
        report = fill_from_weights(inner, weights)
    else:
        report = initialize_all(inner, init_seed, non_persistent_buffer_names(inner) & allocated)
    install_loaded_weights(model)
    return Loaded(model, report)


def _record_conversions(model: nn.Module, plan: CheckpointPlan | None) -> None:
    """Keep on the model the conversions the checkpoint's load applied, as ``from_pretrained`` does
    (``_weight_conversions``): ``save_pretrained`` and the export then revert exactly those, and write the keys in
    transformers' order for a loaded model (sorted, not the module order)."""
    if plan is not None and isinstance(model, PreTrainedModel):
        model._weight_conversions = plan.keys.conversions


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model itself, also when a strategy returned a wrapper around it (Megatron-FSDP's
    ``MegatronFSDP`` keeps it as ``.module``)."""
    inner = getattr(model, "module", None)
    if not isinstance(model, PreTrainedModel) and isinstance(inner, PreTrainedModel):
        return inner
    return model
