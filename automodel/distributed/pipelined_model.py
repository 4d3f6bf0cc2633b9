"""The model a pipeline-parallel load returns: this rank's stages, run by a ``torch.distributed.pipelining`` schedule.

``train_step(**batch)`` splits the batch into the layout's microbatches, runs forward and backward through the
schedule and returns the batch's mean token loss (the value plain transformers' ``model(**batch).loss`` gives on
the whole batch), the same on every rank. Each microbatch's loss is its summed token losses over the whole batch's
token count, and the schedule sums them (``scale_grads=False``), so gradients are those of the batch's mean loss
whatever the split. ``eval_step(**batch)`` runs the forward only.

Tied embeddings work: the first stage holds the input embedding, the last a copy of it as the head's weight (both
loaded from the same checkpoint tensor); after each backward their gradients are summed between the two stages
(Megatron's embedding group), so both take the same optimizer step and stay equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .parallel_model import ParallelizedModel
from .pipeline_layout import PipelineLayout
from .runtime import full_tensor

__all__ = ["PipelinedModel", "pipeline_norm_group"]

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
        self._tokens: torch.Tensor | None = None
        self._device = device
        self._schedule: Any = None
        self._shape: tuple[int, ...] | None = None
        self._is_first = 0 in stage_indices
        self._is_last = layout.num_stages - 1 in stage_indices
        self._last_rank = dist.get_global_rank(self._group, (layout.num_stages - 1) % layout.size)
        self._tied = self._tied_pairs(tied)
        # Every rank creates every embedding group (new_group is collective), whether it holds a tied pair or not.
        self._embedding_group = _embedding_group(layout) if tied else None
        self._owners = self._tensor_owners()
        for name, param in self.named_parameters():
            counted = not (self._is_last and name in {head for _, head in tied} and not self._is_first)
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

    # -- exporting it --------------------------------------------------------------------------------------------------

    def _tensor_owners(self) -> dict[str, int]:
        """Every state tensor of the whole model -> the pipeline rank whose stages hold it (the lowest, for the
        buffers every stage holds)."""
        mine = list(self.state_dict())
        everyone: list[list[str]] = [None] * self.layout.size  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine, group=self._group)
        owners: dict[str, int] = {}
        for rank, names in enumerate(everyone):
            for name in names:
                owners.setdefault(name, rank)
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
    ) -> torch.Tensor:
        """Forward and backward of the batch (every rank passes the same batch of its data-parallel replica) over
        the layout's microbatches; gradients accumulate into ``.grad`` as after ``loss.backward()``. Returns the
        batch's mean token loss (detached), the same on every rank of the pipeline."""
        return self._run(True, input_ids, labels, attention_mask, position_ids)

    def eval_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The batch's mean token loss without gradients, the same on every rank of the pipeline."""
        return self._run(False, input_ids, labels, attention_mask, position_ids)

    def _run(
        self,
        train: bool,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        rows, microbatches = input_ids.shape[0], self.layout.microbatches
        if rows % microbatches:
            raise ValueError(
                f"A batch of {rows} rows cannot be split into pp_microbatches={microbatches} equal microbatches: use "
                f"a batch size that is a multiple of {microbatches}."
            )
        # transformers' causal-LM loss: position t predicts labels[t + 1]; shifted here once for the whole batch.
        shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), _IGNORE_INDEX)], dim=1)
        self._tokens = (shifted != _IGNORE_INDEX).sum().clamp(min=1)
        kwargs = {
            key: value
            for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids))
            if value is not None
        }
        if tuple(input_ids.shape) != self._shape:
            self._new_schedule(tuple(input_ids.shape))
        args = (input_ids,) if self._is_first else ()
        target = shifted if self._is_last else None
        losses: list[torch.Tensor] = []
        if train:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            self._sum_tied_gradients()
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=losses, **kwargs)
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), dtype=torch.float32)
        loss = loss.to(self._device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss.cpu()

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One microbatch's summed token losses over the whole batch's token count (transformers upcasts the
        logits to float32 for its loss)."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        summed = F.cross_entropy(flat, target.reshape(-1), ignore_index=_IGNORE_INDEX, reduction="sum")
        return summed / self._tokens

    def _new_schedule(self, shape: tuple[int, ...]) -> None:
        """Stages and a schedule for batches of ``shape``: torch's stages size their send and receive buffers from
        the first microbatch they run and keep them, so a batch of another shape gets new ones (and runs one
        metadata forward of its first microbatch)."""
        from torch.distributed.pipelining import PipelineStage

        stages = [
            PipelineStage(stage, index, self.layout.num_stages, self._device, group=self._group)
            for stage, index in zip(self.stages, self.stage_indices, strict=True)
        ]
        schedule = _schedule_class(self.layout.schedule)
        target = stages if self.layout.virtual_stages > 1 else stages[0]
        self._schedule = schedule(target, self.layout.microbatches, loss_fn=self._loss, scale_grads=False)
        self._shape = shape

    # -- tied embeddings ------------------------------------------------------------------------------------------------

    def _tied_pairs(self, tied: list[tuple[str, str]]) -> list[torch.Tensor]:
        """The local parameters of each tied (embedding, head) pair split between the first and the last stage."""
        if not tied or self._is_first == self._is_last:
            return []
        parameters = dict(self.named_parameters())
        return [parameters[embedding if self._is_first else head] for embedding, head in tied]

    def _sum_tied_gradients(self) -> None:
        """Sum the gradients of the embedding (first stage) and its copy as the head (last stage) between the two
        stages: the pipeline ranks ``0`` and ``P - 1`` of each stage group coordinate."""
        for param in self._tied:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=self._embedding_group)


def _embedding_group(layout: PipelineLayout) -> Any:
    """The process groups of ranks ``(pp=0, c)`` and ``(pp=P-1, c)`` for every stage-group coordinate ``c``; this
    rank's one (every rank must create every group, in the same order)."""
    world = dist.get_world_size()
    per_stage = world // layout.size
    mine = None
    for coordinate in range(per_stage):
        ranks = [coordinate, (layout.size - 1) * per_stage + coordinate]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine
