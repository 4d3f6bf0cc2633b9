"""The validation loss: the mean token loss over a whole held-out set, every data-parallel rank taking a share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed import MeshContext
from automodel.distributed.fsdp import reshard_all
from automodel.distributed.pipelined_model import PipelinedModel

from .batches import joined_batch
from .data import IGNORE_INDEX, Example
from .vlm import collate_media

__all__ = ["ValidationSet"]


class ValidationSet:
    """Held-out examples, cut into the same number of micro batches on every data-parallel rank (the last ones
    filled with rows that carry no loss, so that every rank runs every collective)."""

    def __init__(self, examples: list[Example], *, micro_batch_size: int, seq_len: int, pad_id: int) -> None:
        if not examples:
            raise ValueError("The validation set holds no examples.")
        self.examples, self.micro_batch_size, self.seq_len, self.pad_id = examples, micro_batch_size, seq_len, pad_id

    def batches(self, dp_rank: int, dp_size: int, *, groups_of: int = 1) -> list[dict[str, torch.Tensor]]:
        """This rank's micro batches: rows ``dp_rank, dp_rank + dp_size, ...`` of the set, padded to equal counts
        (and to a multiple of ``groups_of`` micro batches: a pipeline step's microbatches)."""
        rows = self.examples[dp_rank::dp_size]
        per_rank = math.ceil(len(self.examples) / dp_size)
        step = self.micro_batch_size * groups_of
        count = math.ceil(per_rank / step) * step
        # Filler rows carry no loss; a copy of a real example, so that a vision-language model runs its vision
        # tower (whose sharded blocks gather their weights collectively) on every rank.
        first = self.examples[0]
        filler = dataclasses.replace(first, labels=[IGNORE_INDEX] * len(first.labels))
        rows = rows + [filler] * (count - len(rows))
        return [self._collate(rows[i : i + self.micro_batch_size]) for i in range(0, count, self.micro_batch_size)]

    def _collate(self, rows: list[Example]) -> dict[str, torch.Tensor]:
        input_ids = torch.full((len(rows), self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        packed = any(row.position_ids is not None for row in rows)
        positions = torch.arange(self.seq_len).repeat(len(rows), 1) if packed else None
        for index, row in enumerate(rows):
            input_ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
            labels[index, : len(row.labels)] = torch.tensor(row.labels)
            if row.position_ids is not None:
                positions[index, : len(row.position_ids)] = torch.tensor(row.position_ids)
        batch = {"input_ids": input_ids, "labels": labels}
        if positions is not None:
            batch["position_ids"] = positions
        return {**batch, **collate_media(rows, self.seq_len)}

    @torch.no_grad()
    def loss(
        self,
        model: nn.Module,
        context: MeshContext,
        inputs: Callable[[dict[str, torch.Tensor], MeshContext, torch.device], dict],
    ) -> float:
        """Collective: the mean token loss over the whole set (the model is left in training mode)."""
        device = next(model.parameters()).device
        model.eval()
        totals = torch.zeros(2, device=device, dtype=torch.float64)  # summed token losses, counted tokens
        dp_rank = context.mesh("dp").get_local_rank()
        one = torch.ones((), device=device)
        try:
            if isinstance(model, PipelinedModel):  # one schedule step per group of the pipeline's microbatches
                groups = model.layout.microbatches
                batches = self.batches(dp_rank, context.dp_size, groups_of=groups)
                for start in range(0, len(batches), groups):
                    batch = joined_batch(batches[start : start + groups])
                    totals[0] += model.eval_step(**batch, num_items_in_batch=one).double().to(device)
                    totals[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum().to(device)
            else:
                for batch in self.batches(dp_rank, context.dp_size):
                    counted = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
                    # num_items_in_batch=1: transformers' loss is then the sum of this shard's token losses.
                    output = model(**inputs(batch, context, device), num_items_in_batch=one)
                    totals[0] += output.loss.double()
                    totals[1] += counted.to(device) / context.cp_size  # every CP rank of a dp group holds the batch
        finally:
            model.train()
            reshard_all(model)  # the next training step starts from shards, as after any step
        dist.all_reduce(totals, group=context.mesh("dp_cp").get_group())
        return (totals[0] / totals[1].clamp(min=1)).item()
