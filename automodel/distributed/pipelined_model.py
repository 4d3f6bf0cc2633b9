"""The model a pipeline-parallel load returns: this rank's stages, run by a ``torch.distributed.pipelining`` schedule.

``train_step(**batch)`` splits the batch into the layout's microbatches, runs forward and backward through the
schedule and returns the batch's mean token loss (the value plain transformers' ``model(**batch).loss`` gives on
the whole batch), the same on every rank. Each microbatch's loss is its summed token losses over the whole batch's
token count, and the schedule sums them (``scale_grads=False``), so gradients are those of the batch's mean loss
whatever the split. ``eval_step(**batch)`` runs the forward only.

A loss that runs the output head itself (the recipes' fused linear cross-entropy) is passed as ``head_loss``: the last
stage then hands it the head's input instead of the logits. Each step also measures the pipeline's bubble: the share
of the step each rank spends outside its stages' forward and backward computations (waiting for activations and
gradients), averaged over the pipeline ranks (``last_bubble``).

Tied embeddings work: the first stage holds the input embedding, the last a copy of it as the head's weight; their
gradients are summed between the two stages after each backward (:mod:`.pipeline_tied`). A step that raises on one
rank ends on every rank within moments, each raising a ``StageFailure`` naming its stage and, where the error arose,
the module (:mod:`.pipeline_failure`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel._compat.torch import pipeline_stage

from .parallel_model import ParallelizedModel
from .pipeline_failure import ending_every_stage_on_failure
from .pipeline_layout import V_SHAPED_SCHEDULES, PipelineLayout
from .pipeline_stages import stage_forward
from .pipeline_tied import check_tied_layouts, embedding_group, sum_tied_gradients, tied_layouts, tied_pairs
from .runtime import full_tensor

__all__ = ["HeadLoss", "PipelinedModel", "pipeline_norm_group"]

# ``head_loss(last_stage, head_input, shifted_targets, num_items)``: one microbatch's loss from the output head's input
# (``[rows, seq, hidden]``) and the targets already shifted (position ``t`` predicts ``shifted_targets[:, t]``, ``-100``
# ignored): its summed token losses over ``num_items``. ``last_stage`` is the stage module holding the head.
HeadLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The methods of torch's ``PipelineStage`` that compute (the rest of a schedule's time is waiting and sending).
_COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

_IGNORE_INDEX = -100
# The attribute a pipelined model's parameters carry: (the ``pp`` process group, whether their gradient counts in a
# global norm: a tied copy on the last stage does not, its twin on the first stage does). Read by ``grad_clipping``.
_PIPELINE_ATTRIBUTE = "_automodel_pipeline_norm"


def pipeline_norm_group(param: torch.Tensor) -> tuple[Any, bool] | None:
    """``(pp group, counted)`` for a parameter of a pipelined model, else ``None``."""
    return getattr(param, _PIPELINE_ATTRIBUTE, None)


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as ``nn.Module.load_state_dict`` does."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _schedule_class(name: str) -> type:
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
        "zbv": pipelining.ScheduleZBVZeroBubble,
    }[name]


class PipelinedModel(ParallelizedModel, nn.Module):
    """This rank's pipeline stages of one transformers model (each parallelized on its stage group's meshes).

    ``stages`` holds the local stage modules (copies of the model class in which other stages' parts are
    parameter-free stand-ins). ``named_parameters()`` / ``state_dict()`` give their tensors under transformers'
    names; ``config`` is the model's config. A plain call and ``generate`` are refused: use ``train_step`` and
    ``eval_step``. ``save_pretrained`` / ``push_to_hub`` are collective and write the one consolidated checkpoint
    of the whole model, as without PP.
    """

    def __init__(
        self,
        stages: list[nn.Module],
        stage_indices: list[int],
        layout: PipelineLayout,
        device: torch.device,
        tied: list[tuple[str, str]],
        whole: nn.Module,
    ) -> None:
        super().__init__()
        # The whole model on meta (not a submodule): the names, shapes, ties and config an export writes.
        self.__dict__["whole_on_meta"] = whole
        self.stages = nn.ModuleList(stages)
        self.layout = layout
        self.stage_indices = list(stage_indices)
        self.config = getattr(stages[0], "config", None)
        self._group = layout.mesh.get_group()
        self._device = device
        self._schedule: Any = None
        self._schedule_key: tuple | None = None
        self._num_items: torch.Tensor | None = None
        self._head_loss: HeadLoss | None = None
        self._busy = 0.0
        self.last_bubble: float | None = None  # the last step's idle share, averaged over the pipeline ranks
        self._is_first = 0 in stage_indices
        self._is_last = layout.num_stages - 1 in stage_indices
        self._tied_names = list(tied)
        self._tied = tied_pairs(dict(self.named_parameters()), tied, is_first=self._is_first, is_last=self._is_last)
        # Every rank creates every embedding group (new_group is collective), whether it holds a tied pair or not.
        self._embedding_group = embedding_group(layout) if tied else None
        self._owners = self._tensor_owners()
        for name, param in self.named_parameters():
            counted = not (self._is_last and name in {head for _, head in tied})  # its embedding twin counts
            setattr(param, _PIPELINE_ATTRIBUTE, (self._group, counted))

    # -- the model's tensors under transformers' names -------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[str] = set()
        for stage in self.stages:
            for name, param in stage.named_parameters(prefix, recurse, remove_duplicate):
                if name not in seen:
                    seen.add(name)
                    yield name, param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()  # every stage holds the shared buffers (rotary frequencies): once each
        for stage in self.stages:
            for name, buffer in stage.named_buffers(prefix, recurse, remove_duplicate):
                if name not in seen:
                    seen.add(name)
                    yield name, buffer

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for stage in self.stages:
            for name, value in stage.state_dict(*args, **kwargs).items():
                merged.setdefault(name, value)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        missing, unexpected = [], set(state_dict)
        for stage in self.stages:
            own = stage.state_dict()
            result = stage.load_state_dict(
                {k: v for k, v in state_dict.items() if k in own}, strict=False, assign=assign
            )
            missing += result.missing_keys
            unexpected -= set(own)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error loading the state of a pipeline stage: missing {sorted(missing)[:10]}, unexpected keys of "
                f"no local stage {sorted(unexpected)[:10]}."
            )
        return IncompatibleKeys(missing, sorted(unexpected))

    def state_module(self) -> nn.Module:
        """This rank's stage parts as one module tree whose state names are transformers' names: what
        ``torch.distributed.checkpoint`` saves and loads (``get_state_dict(model.state_module(), optimizer)``), so a
        training checkpoint of a pipelined run has the keys of one without PP and resumes with any layout.

        Modules that several local stages hold parts of (``model``, ``model.layers``) are parameter-free containers
        of their parts; the real modules are the stages' own. On the last stage, a tied head's copy also answers to
        its embedding's name (as a tied model's head does), so its weight and optimizer state are saved and loaded
        under the embedding's key, the same values the first stage holds."""
        view = _merged(list(self.stages))
        if self._is_last and not self._is_first and self._tied_names:
            view = _container(view, children=True)  # never add to a stage's own modules
            for embedding, head in self._tied_names:
                _place(view, embedding, view.get_parameter(head))
        return view

    # -- exporting it --------------------------------------------------------------------------------------------------

    def tensors_renamed(self) -> None:
        """Collective: after the stages' tensors were renamed in place (``merge_lora`` puts base layers back), look up
        again which pipeline rank holds each tensor for an export."""
        self._owners = self._tensor_owners()

    def _tensor_owners(self) -> dict[str, int]:
        """Every state tensor of the whole model -> the pipeline rank whose stages hold it (the lowest, for the
        buffers every stage holds). The same exchange checks that each tied pair split between the first and the
        last stage is laid out alike on both (:func:`~.pipeline_tied.check_tied_layouts`)."""
        mine = (list(self.state_dict()), tied_layouts(dict(self.named_parameters()), self._tied_names))
        everyone: list[tuple[list[str], dict]] = [None] * self.layout.size  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine, group=self._group)
        owners: dict[str, int] = {}
        for rank, (names, _) in enumerate(everyone):
            for name in names:
                owners.setdefault(name, rank)
        check_tied_layouts([layouts for _, layouts in everyone], self._tied_names)
        return owners

    def gatherer(self) -> Callable[[str], torch.Tensor | None]:
        """For an export: a function that, called collectively (every rank, every name in the same order), gives
        the full value of state tensor ``name`` on global rank 0 (on the CPU) and ``None`` elsewhere. The stage group
        holding it gathers it; that group's first rank sends it to rank 0."""
        state = self.state_dict()
        whole = self.whole_on_meta.state_dict()  # shapes and dtypes of what rank 0 receives
        per_stage = dist.get_world_size() // self.layout.size
        rank = dist.get_rank()

        def gather(name: str) -> torch.Tensor | None:
            owner = self._owners[name]
            full = full_tensor(state[name]).detach() if self.layout.rank == owner else None
            if rank == 0:
                if owner != 0:
                    full = torch.empty(whole[name].shape, dtype=whole[name].dtype, device=self._device)
                    dist.recv(full, src=owner * per_stage)
                return full.cpu()
            if full is not None and rank == owner * per_stage:
                dist.send(full.contiguous().to(self._device), dst=0)
            return None

        return gather

    # -- running it ---------------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "A pipeline-parallel model runs its stages through a schedule, not a plain call: use "
            "model.train_step(input_ids=..., labels=...) (forward, backward and the mean token loss) or "
            "model.eval_step(...) (the loss without gradients)."
        )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "generate() is not available on a pipeline-parallel model (each rank holds a few stages). Export it "
            "(save_pretrained) and generate with the exported checkpoint, or load it with pp_size=1."
        )

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        num_items_in_batch: torch.Tensor | None = None,
        head_loss: HeadLoss | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the batch (every rank passes the same batch of its data-parallel replica) over
        the layout's microbatches; gradients accumulate into ``.grad`` as after ``loss.backward()``. Returns the
        batch's summed token losses over ``num_items_in_batch`` (default: the batch's own token count, i.e. its mean
        token loss; a data-parallel loop passes its global count over the ranks gradients are averaged over),
        detached, the same on every rank of the pipeline. ``head_loss`` replaces the cross-entropy on the logits
        (see :data:`HeadLoss`)."""
        return self._run(True, input_ids, labels, attention_mask, position_ids, num_items_in_batch, head_loss)

    def eval_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The batch's summed token losses over ``num_items_in_batch`` (default: its mean token loss) without
        gradients, the same on every rank of the pipeline."""
        return self._run(False, input_ids, labels, attention_mask, position_ids, num_items_in_batch, None)

    def _run(
        self,
        train: bool,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        num_items: torch.Tensor | None,
        head_loss: HeadLoss | None,
    ) -> torch.Tensor:
        rows, microbatches = input_ids.shape[0], self.layout.microbatches
        if rows % microbatches:
            raise ValueError(
                f"A batch of {rows} rows cannot be split into pp_microbatches={microbatches} equal microbatches: use "
                f"a batch size that is a multiple of {microbatches}."
            )
        # transformers' causal-LM loss: position t predicts labels[t + 1]; shifted here once for the whole batch.
        shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), _IGNORE_INDEX)], dim=1)
        if num_items is None:
            num_items = (shifted != _IGNORE_INDEX).sum().clamp(min=1)
        self._num_items = torch.as_tensor(num_items, device=self._device)
        kwargs = {
            key: value
            for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids))
            if value is not None
        }
        key = (tuple(input_ids.shape), head_loss is not None)
        if key != self._schedule_key:
            self._new_schedule(key)
        self._head_loss = head_loss
        args = (input_ids,) if self._is_first else ()
        target = shifted if self._is_last else None
        losses: list[torch.Tensor] = []
        self._busy, start = 0.0, time.perf_counter()
        failing = ending_every_stage_on_failure(list(self.stages), self.stage_indices, self.layout.num_stages)
        try:
            with failing:
                if train:
                    self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
                    sum_tied_gradients(self._tied, self._embedding_group)
                elif self.layout.schedule in V_SHAPED_SCHEDULES:
                    self._eval_by_a_step(args, target, losses, kwargs)
                else:
                    with torch.no_grad():
                        self._schedule.eval(*args, target=target, losses=losses, **kwargs)
        finally:
            self._head_loss = None
        idle = max(0.0, 1.0 - self._busy / max(time.perf_counter() - start, 1e-9))
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), dtype=torch.float32)
        # One collective for both: the loss (only the last stage's rank holds it: the others add zeros, exactly) and
        # the idle shares of all pipeline ranks.
        facts = torch.stack([loss.double().cpu(), torch.tensor(idle, dtype=torch.float64)]).to(self._device)
        dist.all_reduce(facts, group=self._group)
        self.last_bubble = facts[1].item() / self.layout.size
        return facts[0].float().cpu()

    def _eval_by_a_step(self, args: tuple, target: Any, losses: list, kwargs: dict) -> None:
        """The losses of a V-shaped schedule without a training step: torch's ``eval()`` of ``ScheduleZBVZeroBubble``
        hangs (its ranks still exchange for the backward it skips), and torch validates every schedule it runs for
        a full backward; so eval runs the schedule's step and puts the gradients back as they were (a backward's
        cost, for the rare evaluation)."""
        params = list(self.parameters())
        kept = [param.grad for param in params]
        for param in params:
            param.grad = None
        try:
            with torch.enable_grad():  # also when called under no_grad (a validation pass)
                self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            for param, grad in zip(params, kept, strict=True):
                param.grad = grad

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One microbatch's summed token losses over ``num_items`` (transformers upcasts the logits to float32 for
        its loss), or ``head_loss`` on the head's input."""
        if self._head_loss is not None:
            return self._head_loss(self._last_stage(), output, target, self._num_items)
        flat = output.float().reshape(-1, output.shape[-1])
        summed = F.cross_entropy(flat, target.reshape(-1), ignore_index=_IGNORE_INDEX, reduction="sum")
        return summed / self._num_items

    def _last_stage(self) -> nn.Module:
        return self.stages[self.stage_indices.index(self.layout.num_stages - 1)]

    def _new_schedule(self, key: tuple[tuple[int, ...], bool]) -> None:
        """Stages and a schedule for batches of one shape and output (logits, or the head's input for a
        ``head_loss``): torch's stages size their send and receive buffers from the first microbatch they run and
        keep them, so a batch of another shape gets new ones (and runs one metadata forward of its first
        microbatch)."""
        shape, head_input = key
        if self._is_last:
            stage_forward(self._last_stage()).return_head_input = head_input
        stages = [
            pipeline_stage(stage, index, self.layout.num_stages, self._device, group=self._group)
            for stage, index in zip(self.stages, self.stage_indices, strict=True)
        ]
        for stage in stages:
            for name in _COMPUTE_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, functools.partial(self._timed, getattr(stage, name)))
        schedule = _schedule_class(self.layout.schedule)
        target = stages if self.layout.virtual_stages > 1 else stages[0]
        self._schedule = schedule(target, self.layout.microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedule_key = key

    def _timed(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one of a stage's compute methods, adding its time to this step's busy time."""
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self._busy += time.perf_counter() - start


def _is_stand_in(module: nn.Module | None) -> bool:
    return module is None or getattr(module, "absent_from_stage", False)


def _merged(modules: list[nn.Module]) -> nn.Module | None:
    """The part of one module path that ``modules`` (the same path in each local stage) really hold: the module
    itself when one stage holds it, else a container of its merged children (tensors of its own, such as shared
    buffers, from the first)."""
    real = [module for module in modules if not _is_stand_in(module)]
    if len(real) <= 1:
        return real[0] if real else None
    container = _container(real[0], children=False)
    for name in real[0]._modules:
        child = _merged([module._modules.get(name) for module in real])
        if child is not None:
            container._modules[name] = child
    return container


def _container(module: nn.Module, *, children: bool) -> nn.Module:
    """A plain module holding ``module``'s own parameters and buffers (and its children when ``children``), so
    that it can be added to without changing ``module``."""
    container = nn.Module()
    container._parameters.update(module._parameters)
    container._buffers.update(module._buffers)
    container._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    if children:
        container._modules.update(module._modules)
    return container


def _place(view: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` under the dotted ``name`` in ``view``, in containers (not in the stages' own modules)."""
    *path, leaf = name.split(".")
    node = view
    for part in path:
        child = node._modules.get(part)
        child = nn.Module() if _is_stand_in(child) else _container(child, children=True)
        node._modules[part] = child
        node = child
    node._parameters[leaf] = param
