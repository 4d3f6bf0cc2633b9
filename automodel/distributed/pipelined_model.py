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

Tied embeddings work: the first stage holds the input embedding, the last a copy of it as the head's weight (both
loaded from the same checkpoint tensor); after each backward their gradients are summed between the two stages
(Megatron's embedding group), so both take the same optimizer step and stay equal.
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
from torch.distributed.tensor import DTensor

from automodel._compat.torch import pipeline_stage

from .parallel_model import ParallelizedModel
from .pipeline_layout import V_SHAPED_SCHEDULES, PipelineLayout
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
        self._tied = self._tied_pairs(tied)
        self._tied_names = list(tied)
        # Every rank creates every embedding group (new_group is collective), whether it holds a tied pair or not.
        self._embedding_group = _embedding_group(layout) if tied else None
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

    def _tensor_owners(self) -> dict[str, int]:
        """Every state tensor of the whole model -> the pipeline rank whose stages hold it (the lowest, for the
        buffers every stage holds). The same exchange checks that each tied pair split between the first and the
        last stage is laid out alike on both (:meth:`_check_tied_layouts`)."""
        mine = (list(self.state_dict()), self._tied_layouts())
        everyone: list[tuple[list[str], dict]] = [None] * self.layout.size  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine, group=self._group)
        owners: dict[str, int] = {}
        for rank, (names, _) in enumerate(everyone):
            for name in names:
                owners.setdefault(name, rank)
        self._check_tied_layouts([layouts for _, layouts in everyone])
        return owners

    def _tied_layouts(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """This rank's tied embedding and head copies: name -> (placements, local shape)."""
        held = dict(self.named_parameters())
        return {
            name: (str(getattr(held[name], "placements", None)), tuple(_local(held[name]).shape))
            for pair in self._tied_names
            for name in pair
            if name in held
        }

    def _check_tied_layouts(self, layouts: list[dict[str, tuple[str, tuple[int, ...]]]]) -> None:
        """Raise (on every rank of the pipeline) when the first stage's embedding and the last stage's head, one
        tied weight, are sharded differently: their gradients could not be summed slice by slice. Without PP the
        TP step refuses such a plan for the one tied parameter; under PP each stage is parallelized alone."""
        seen = {name: layout for held in layouts for name, layout in held.items()}
        for embedding, head in self._tied_names:
            if embedding in seen and head in seen and seen[embedding] != seen[head]:
                raise ValueError(
                    f"The tied parameters {embedding} (first pipeline stage) and {head} (last stage) are laid out "
                    f"differently: {seen[embedding]} vs {seen[head]} (placements, local shape). Give them the same "
                    "placement in the TP plan, or untie them (tie_word_embeddings=False)."
                )

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
        try:
            if train:
                self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
                self._sum_tied_gradients()
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
            self._last_stage().forward.return_head_input = head_input
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

    # -- tied embeddings ------------------------------------------------------------------------------------------------

    def _tied_pairs(self, tied: list[tuple[str, str]]) -> list[list[torch.Tensor]]:
        """The local parameters of each tied (embedding, head) pair split between the first and the last stage:
        one of them on each of the two ranks, or both on a rank holding both stages (the V-shaped schedules)."""
        if not tied or not (self._is_first or self._is_last):
            return []
        parameters = dict(self.named_parameters())
        held = [name for name, side in ((0, self._is_first), (1, self._is_last)) if side]
        return [[parameters[pair[side]] for side in held] for pair in tied]

    def _sum_tied_gradients(self) -> None:
        """Sum the gradients of the embedding (first stage) and its copy as the head (last stage): between the two
        stages' ranks (each stage-group coordinate's ranks holding them), or locally when one rank holds both.

        Each gradient is first laid out as its parameter (:func:`_laid_out_as_parameter`): under TP the two copies'
        gradients may come out of their backwards with different placements (a vocab-sharded embedding's lookup
        gradient is replicated, the colwise head's is sharded), and their local tensors would not be the same slice
        (nor of the same size) of the one tied weight."""
        for params in self._tied:
            grads = [_laid_out_as_parameter(param) for param in params if param.grad is not None]
            if not grads:
                continue
            local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
            if len(params) == 2:
                total = sum(local[1:], local[0].clone())
                for grad in local:
                    grad.copy_(total)
            else:
                dist.all_reduce(local[0], group=self._embedding_group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _laid_out_as_parameter(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` with ``param``'s placements (set back as its ``.grad``): DTensor's embedding backward gives a
    vocab-sharded (``Shard(0)``) embedding a replicated gradient; redistributing it keeps this rank's rows (no
    collective for a replicated gradient, a reduce-scatter over the parameter's mesh for a partial one)."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return grad


def _embedding_group(layout: PipelineLayout) -> Any:
    """The process groups of the first and the last stage's ranks, ``(pp=first, c)`` and ``(pp=last, c)``, for every
    stage-group coordinate ``c``; this rank's one (every rank must create every group, in the same order). ``None``
    when one pipeline rank holds both stages."""
    first, last = layout.stage_rank(0), layout.stage_rank(layout.num_stages - 1)
    if first == last:
        return None
    world = dist.get_world_size()
    per_stage = world // layout.size
    mine = None
    for coordinate in range(per_stage):
        ranks = [first * per_stage + coordinate, last * per_stage + coordinate]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


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
