"""Rank-side cases for expert parallelism (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from automodel.distributed import MeshContext, ModelParallelizer, fully_shard_default
from automodel.distributed.expert_parallel import expert_module_names
from tests.parity import compare_with_reference
from tests.tiny_models import build_model, tiny_config, token_batch


def _count_routes(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[Any]]:
    """Record, per experts module, how many (token, expert) pairs each expert receives in the next forward."""
    counts: list[torch.Tensor] = []

    def record(module, args):
        top_k_index = args[1]
        counts.append(torch.bincount(top_k_index.reshape(-1), minlength=module.num_experts))

    handles = [model.get_submodule(name).register_forward_pre_hook(record) for name in expert_module_names(model)]
    return counts, handles


def ep_parity(layout: dict[str, Any], architecture: str, same_token: bool = False) -> dict[str, Any]:
    """Parallelize a tiny MoE model with ``layout`` (EP > 1) and compare against one plain process.

    ``same_token``: every position holds one token id, so every token routes to the same experts and the others get
    no tokens at all (their owners receive empty all-to-all exchanges but must still join backward).
    """
    context = MeshContext.build(**layout)
    reference = build_model(tiny_config(architecture))
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    counts, handles = _count_routes(reference)
    batch = torch.full((8, 8), 5) if same_token else token_batch()
    result = compare_with_reference(reference, model, context, batch)
    for handle in handles:
        handle.remove()
    expert = next(p for n, p in model.named_parameters() if "experts" in n)
    result["routes_per_expert"] = torch.stack(counts).tolist()
    result["expert_placements"] = [str(p) for p in expert.placements] if isinstance(expert, DTensor) else []
    result["expert_local_experts"] = expert.to_local().shape[0] if isinstance(expert, DTensor) else None
    return result


def ep_error(layout: dict[str, Any], architecture: str, **overrides: Any) -> str:
    """The error parallelizing a tiny model with ``layout`` raises."""
    context = MeshContext.build(**layout)
    try:
        ModelParallelizer().parallelize(build_model(tiny_config(architecture, **overrides)), context)
    except ValueError as error:
        return str(error)
    return "no error"


class _RecordingMoEParallelizer(ModelParallelizer):
    """A sidecar overriding only the FSDP primitive, optionally declaring it safe on the MoE path."""

    def __init__(self, customizes_moe_fsdp: bool) -> None:
        self._customizes_moe_fsdp = customizes_moe_fsdp
        self.sharded: list[str] = []

    def _fully_shard_module(self, module, **kwargs):
        self.sharded.append(type(module).__name__)
        return fully_shard_default(module, **kwargs)


def moe_fsdp_primitive(customizes_moe_fsdp: bool) -> dict[str, Any]:
    """Which modules went through the sidecar's ``_fully_shard_module`` on the MoE path (EP=2), and parity."""
    context = MeshContext.build("fsdp2", ep_size=2)
    reference = build_model(tiny_config("mixtral"))
    parallelizer = _RecordingMoEParallelizer(customizes_moe_fsdp)
    model = parallelizer.parallelize(copy.deepcopy(reference), context)
    units = [type(module).__name__.removeprefix("FSDP") for module in model.modules() if isinstance(module, FSDPModule)]
    return {
        "sharded": parallelizer.sharded,
        "fsdp_units": units,
        **compare_with_reference(reference, model, context, token_batch()),
    }


def parity_or_refusal(layout: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Parity of a tiny model parallelized for ``layout`` (dense or EP), or the ``ValueError`` it is refused with."""
    context = MeshContext.build(**layout)
    reference = build_model(tiny_config(architecture))
    try:
        model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    except ValueError as error:
        return {"refused": str(error)}
    views = _record_view_outputs_of_fsdp_units(model)
    return {"refused": None, **compare_with_reference(reference, model, context, token_batch()), "view_outputs": views}


def _record_view_outputs_of_fsdp_units(model: torch.nn.Module) -> list[str]:
    """The FSDP units that return a view in the next forwards (an in-place op on it would drop FSDP2's pre-backward
    hook; FSDP2 warns about each)."""
    views: list[str] = []

    def record(name: str):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, torch.Tensor) and first._is_view() and name not in views:
                views.append(name)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.register_forward_hook(record(name))
    return views


def router_loss_step(layout: dict[str, Any], micro_batches: int) -> dict[str, float]:
    """A training step of Mixtral with its auxiliary router loss on (coefficient 0.5), split into ``micro_batches``
    per rank, against one plain process: the whole batch's cross-entropy plus the coefficient times the mean of the
    router loss over every rank's micro batches (each the model's own on its tokens)."""
    import torch.distributed as dist

    from automodel.training.step import train_step

    config = tiny_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    reference = build_model(config)
    context = MeshContext.build(**layout)
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    batch = token_batch(batch_size=8)
    rows = batch.shape[0] // context.dp_size
    mine = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
    pieces = mine.chunk(micro_batches)
    loss = train_step(model, [{"input_ids": piece, "labels": piece} for piece in pieces], context)
    with torch.no_grad():
        cross_entropy = reference(input_ids=batch, labels=batch, output_router_logits=False).loss
        every_piece = batch.chunk(context.dp_size * micro_batches)
        aux = torch.stack([reference(input_ids=piece, output_router_logits=True).aux_loss for piece in every_piece])
    dist.barrier()
    return {"loss": abs(loss.item() - (cross_entropy + 0.5 * aux.mean()).item())}
