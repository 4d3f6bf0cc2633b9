"""Loading a model under pipeline parallelism: split it into stages on meta, parallelize each of this rank's stages
on its stage group's meshes, and fill each from the checkpoint (only the stage's tensors, only their local
shards), from full in-memory weights, or by the model's own init."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch
from torch import nn

from automodel.distributed import MeshContext
from automodel.distributed.model_structure import tied_parameter_names
from automodel.distributed.parallelizer import parallelizer_for
from automodel.distributed.pipeline_stages import PipelineRoles, build_stage, pipeline_roles, stage_layer_counts
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import device_of, log_rank_zero

from .agreement import agree_or_raise
from .fill import fill_from_weights, initialize_all
from .initialization import non_persistent_buffer_names
from .loader import CheckpointPlan, load_checkpoint, materialize
from .sharded_loader import Loaded, LoadReport, state_tensors

__all__ = [
    "StageSplit",
    "load_pipeline_stages",
    "parallelized_stage",
    "split_into_stages",
    "stage_checkpoint_plan",
    "tied_aliases",
]

logger = logging.getLogger(__name__)


def load_pipeline_stages(
    model: nn.Module,
    context: MeshContext,
    plan: CheckpointPlan | None,
    weights: Mapping[str, torch.Tensor] | None,
    init_seed: int | None,
    progress: bool,
) -> Loaded:
    """``model`` (on meta, checked against the checkpoint ``plan`` as a whole) as this rank's filled stages."""
    layout = context.pipeline
    split = split_into_stages(model, context)
    aliases = tied_aliases(model)
    tied = _split_ties(model, split.roles)
    stages, report = [], LoadReport()
    parallelized = _parallelized_stages(model, split, context)
    for position, (index, stage) in enumerate(zip(layout.local_stages, parallelized, strict=True)):
        last_local = position == len(layout.local_stages) - 1
        allocated = materialize(stage, device_of(context))
        stage_report, error = LoadReport(), None
        try:
            stage_report = _fill_stage(stage, plan, weights, init_seed, aliases, allocated, progress, last_local)
        except AttributeError as exc:
            if "_SkippedLayer" not in str(exc) and "_Absent" not in str(exc):
                raise
            # The model's own init reads a module another stage holds (FalconH1Model's walks every layer's mixer).
            error = ValueError(
                f"{type(model).__name__} cannot be split into pipeline stages: its `_init_weights` reads parts of "
                f"other stages ({exc}). Use pp_size=1."
            )
        agree_or_raise(error, f"Filling pipeline stage {index} of {type(model).__name__}")
        report = _combined(report, stage_report)
        stages.append(stage)
    pipelined = PipelinedModel(stages, layout.local_stages, layout, device_of(context), tied, model)
    return Loaded(pipelined, report)


def _parallelized_stages(model: nn.Module, split: StageSplit, context: MeshContext) -> list[nn.Module]:
    """Collective: this rank's stages, parallelized (still on meta). A refusal on one stage (its parts alone may break
    a rule the others keep) is raised on every rank of every stage with the same message, before anything is
    allocated: the other stages' ranks would otherwise go on to load and wait for it."""
    stages, error = [], None
    try:
        stages = [parallelized_stage(model, split, index, context) for index in context.pipeline.local_stages]
    except Exception as exc:  # noqa: BLE001 - any failure, raised on every rank by agree_or_raise
        error = exc
    agree_or_raise(error, f"Parallelizing the pipeline stages of {type(model).__name__}")
    return stages


def _fill_stage(
    stage: nn.Module,
    plan: CheckpointPlan | None,
    weights: Mapping[str, torch.Tensor] | None,
    init_seed: int | None,
    aliases: dict[str, str],
    allocated: set[str],
    progress: bool,
    close: bool,
) -> LoadReport:
    """Fill one materialized stage from the checkpoint, full in-memory weights, or the model's own init."""
    if plan is not None:
        stage_plan = stage_checkpoint_plan(plan, stage, aliases)
        return load_checkpoint(stage, stage_plan, progress=progress, allocated=allocated, close=close)
    if weights is not None:
        own = {name: weights[aliases.get(name, name)] for name in _names(stage) if aliases.get(name, name) in weights}
        return fill_from_weights(stage, own)
    return initialize_all(stage, init_seed, non_persistent_buffer_names(stage) & allocated)


def _names(stage: nn.Module) -> list[str]:
    return [name for name, _ in state_tensors(stage)] + [name for name, _ in stage.named_buffers()]


def _split_ties(model: nn.Module, roles: PipelineRoles) -> list[tuple[str, str]]:
    """The tied groups the split separates: ``(name on the first stage, name on the last stage)`` for each group
    with a name in an input module and one in an output module (tied embeddings and head)."""
    inputs = tuple(f"{name}." for name in (*roles.inputs, *roles.unused))
    outputs = tuple(f"{name}." for name in roles.outputs)
    pairs = []
    for group in tied_parameter_names(model):
        first = [name for name in group if name.startswith(inputs)]
        last = [name for name in group if name.startswith(outputs)]
        if first and last:
            pairs.append((first[0], last[0]))
    return pairs


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How a model is cut: its pipeline roles and the decoder layers of each stage (``layers[index]``)."""

    roles: PipelineRoles
    layer_counts: list[int]

    def layers(self, index: int) -> range:
        start = sum(self.layer_counts[:index])
        return range(start, start + self.layer_counts[index])


def split_into_stages(model: nn.Module, context: MeshContext) -> StageSplit:
    """Collective: ``model``'s (on meta) split into ``context.pipeline``'s stages, logged on rank 0; what cannot be
    split raises on every rank with the same message."""
    layout = context.pipeline
    split, error = None, None
    try:
        roles = pipeline_roles(model)
        split = StageSplit(roles, stage_layer_counts(roles.num_layers, layout.num_stages))
        _check_ties_across_stages(model, split)
    except ValueError as exc:
        error = exc
    agree_or_raise(error, f"Splitting {type(model).__name__} into {layout.num_stages} pipeline stages")
    log_rank_zero(
        logger,
        "pipeline: %d stages over pp=%d (%s, %d microbatches), decoder layers per stage %s",
        layout.num_stages,
        layout.size,
        layout.schedule,
        layout.microbatches,
        split.layer_counts,
    )
    return split


def _check_ties_across_stages(model: nn.Module, split: StageSplit) -> None:
    """Refuse a parameter shared by parts of different stages, other than the embedding and the head (whose gradients
    the pipeline sums, ``_split_ties``): each stage would train its own copy (Zamba's transformer block shared by
    decoder layers on both sides of a cut)."""
    roles = split.roles
    owner = {name: 0 for name in (*roles.inputs, *roles.unused)}
    owner |= {name: len(split.layer_counts) - 1 for name in roles.outputs}
    for index in range(len(split.layer_counts)):
        owner |= {roles.layers[layer]: index for layer in split.layers(index)}
    ends = tuple(f"{name}." for name in (*roles.inputs, *roles.unused, *roles.outputs))
    for group in tied_parameter_names(model):
        if all(name.startswith(ends) for name in group):
            continue  # the embedding and the head: summed between the first and the last stage
        stages = {index for name in group for module, index in owner.items() if name.startswith(f"{module}.")}
        if len(stages) > 1:
            raise ValueError(
                f"{type(model).__name__} cannot be split into pipeline stages: {group[0]} is one parameter with "
                f"{', '.join(group[1:3])}{' ...' if len(group) > 3 else ''}, held by stages {sorted(stages)}, whose "
                "gradients would not be summed. Use pp_size=1."
            )


def parallelized_stage(model: nn.Module, split: StageSplit, index: int, context: MeshContext) -> nn.Module:
    """Stage ``index`` of ``model`` (on meta), parallelized by the model's parallelizer on this rank's stage
    group's meshes."""
    last = index == context.pipeline.num_stages - 1
    stage = build_stage(model, split.roles, split.layers(index), first=index == 0, last=last)
    return parallelizer_for(model).parallelize(stage, context)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every tied parameter name -> its group's first name (the one a checkpoint stores)."""
    return {name: group[0] for group in tied_parameter_names(model) for name in group}


def stage_checkpoint_plan(plan: CheckpointPlan, stage: nn.Module, aliases: dict[str, str]) -> CheckpointPlan:
    """``plan`` restricted to ``stage``'s tensors; a tied name the split separated (the head's weight on the last
    stage) reads its group's checkpoint tensor."""
    names = {name for name, _ in state_tensors(stage)}
    sources = {}
    for name in names:
        source = plan.keys.sources.get(name) or plan.keys.sources.get(aliases.get(name, name))
        if source is not None:
            sources[name] = source
    missing = [name for name in plan.keys.missing if name in names]
    keys = dataclasses.replace(plan.keys, sources=sources, missing=missing)
    return dataclasses.replace(plan, keys=keys)


def _combined(total: LoadReport, stage: LoadReport) -> LoadReport:
    return LoadReport(
        loaded=total.loaded + stage.loaded,
        initialized=total.initialized + stage.initialized,
        bytes_read=max(total.bytes_read, stage.bytes_read),  # the files' counters run on over this rank's stages
        bytes_spanned=max(total.bytes_spanned, stage.bytes_spanned),
        seconds=total.seconds + stage.seconds,
        peak_rss_bytes=max(total.peak_rss_bytes, stage.peak_rss_bytes),
        dequantized=stage.dequantized or total.dequantized,
    )
