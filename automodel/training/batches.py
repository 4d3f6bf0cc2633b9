"""``DistributedBatchLoader``: deterministic batches of tokenized examples, sharded over the data-parallel ranks and
resumable mid-epoch from a plain-int state."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .data import IGNORE_INDEX, Example, _check_positive
from .vlm import collate_media

__all__ = ["DistributedBatchLoader", "PrefetchingLoader", "joined_batch"]

logger = logging.getLogger(__name__)


class DistributedBatchLoader:
    """Deterministic batches, sharded over data-parallel ranks, resumable mid-epoch.

    Each epoch shuffles the example indices with a ``torch.Generator`` seeded from ``(seed, epoch)``. Global batch
    ``s`` of an epoch is the permutation's ``s``-th run of ``global_batch_size`` indices; it is cut into ``dp_size``
    contiguous slices, rank ``dp_rank`` takes its slice and cuts it into micro batches of ``micro_batch_size`` (so
    gradient accumulation steps = ``global_batch_size // (micro_batch_size * dp_size)``). The examples that do not
    fill a last global batch of an epoch are dropped for that epoch (a fresh shuffle draws different ones next
    epoch). Micro batches are right-padded to ``seq_len`` with ``pad_id`` / ``-100``.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seq_len: int,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_positive(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp_size=dp_size, seq_len=seq_len
        )
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size * dp_size = "
                f"{micro_batch_size} * {dp_size}; pick a global batch that is a multiple of {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if len(examples) < global_batch_size:
            raise ValueError(
                f"{len(examples)} examples are fewer than one global batch of {global_batch_size}; add data or lower "
                "global_batch_size"
            )
        if isinstance(examples, list):  # read on demand (prepared data) they are seq_len long at most by construction
            for index, example in enumerate(examples):
                if len(example.input_ids) > seq_len:
                    raise ValueError(f"Example {index} has {len(example.input_ids)} tokens > seq_len={seq_len}")
        self._examples = examples
        self._global_batch_size = global_batch_size
        self._micro_batch_size = micro_batch_size
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self._seq_len, self._pad_id, self._seed, self._shuffle = seq_len, pad_id, seed, shuffle
        self._epoch, self._step = 0, 0
        self._order: torch.Tensor | None = None
        dropped = len(examples) % global_batch_size
        if dropped:
            logger.warning(
                "%d of %d examples do not fill a last global batch of %d and are skipped each epoch",
                dropped,
                len(examples),
                global_batch_size,
            )

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch."""
        return len(self._examples) // self._global_batch_size

    @property
    def grad_accumulation_steps(self) -> int:
        """Micro batches per rank per global batch."""
        return self._global_batch_size // (self._micro_batch_size * self._dp_size)

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro batches of the next global step, ``[{"input_ids", "labels"}]`` of LongTensor
        ``[micro_batch_size, seq_len]``; wraps into the next epoch transparently."""
        if self._step == self.steps_per_epoch:
            self._epoch, self._step, self._order = self._epoch + 1, 0, None
        rank_size = self._global_batch_size // self._dp_size
        start = self._step * self._global_batch_size + self._dp_rank * rank_size
        if not self._shuffle:  # an order of its own (a blend): epoch e continues it at e * len(examples)
            first = self._epoch * len(self._examples) + start
            indices = list(range(first, first + rank_size))
        else:
            if self._order is None:
                self._order = _epoch_permutation(len(self._examples), self._seed, self._epoch)
            indices = self._order[start : start + rank_size].tolist()
        self._step += 1
        micro = self._micro_batch_size
        return [self._collate(indices[i : i + micro]) for i in range(0, rank_size, micro)]

    def state_dict(self) -> dict:
        """Where the loader stands: plain ints (epoch, step within it, seed, and the sizes it must resume with)."""
        return {
            "epoch": self._epoch,
            "step": self._step,
            "seed": self._seed,
            "num_examples": len(self._examples),
            "global_batch_size": self._global_batch_size,
            "data_fingerprint": self._fingerprint(),
        }

    def _fingerprint(self) -> int:
        """A hash of the examples' count and of the tokens of up to 64 of them, evenly spaced: another file, tokenizer,
        ``seq_len`` or packing gives other examples (reading 64 is cheap for prepared data of any size)."""
        digest = hashlib.sha256(str(len(self._examples)).encode())
        count = len(self._examples)
        for index in sorted({position * (count - 1) // 63 for position in range(64)} if count else ()):
            digest.update(str(self._examples[index].input_ids).encode())
        return int(digest.hexdigest()[:15], 16)  # a plain int, as the rest of the state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (the run's seed included); the data (the examples it gives) and the global batch
        size must be the same."""
        same_data = "the same data, tokenizer, train.seq_len and data.packing (they make the examples)"
        if "num_examples" in state and state["num_examples"] != len(self._examples):
            raise ValueError(
                f"Cannot resume: the checkpoint's loader had {state['num_examples']} examples, this one has "
                f"{len(self._examples)}; resume with {same_data}, or start over in another checkpoint.dir"
            )
        if "global_batch_size" in state and state["global_batch_size"] != self._global_batch_size:
            raise ValueError(
                f"Cannot resume: the checkpoint's loader had global_batch_size={state['global_batch_size']}, this one "
                f"has {self._global_batch_size}; resume with the same train.global_batch_size"
            )
        if "data_fingerprint" in state and state["data_fingerprint"] != self._fingerprint():
            raise ValueError(
                f"Cannot resume: the data gives other examples than the checkpoint's (the same number, other tokens); "
                f"resume with {same_data}, or start over in another checkpoint.dir"
            )
        if not 0 <= state["step"] <= self.steps_per_epoch:
            raise ValueError(f"Loader state step={state['step']} is outside [0, {self.steps_per_epoch}]")
        self._epoch, self._step, self._seed = int(state["epoch"]), int(state["step"]), int(state["seed"])
        self._order = None

    def _collate(self, indices: Iterable[int]) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``labels`` right-padded to ``seq_len``; ``num_tokens``, the tokens that are not padding;
        ``position_ids`` when the examples are packed (positions restarting per packed example); the image tensors
        and per-token inputs of vision-language examples (:func:`vlm.collate_media`)."""
        examples = [self._examples[index] for index in indices]
        input_ids = torch.full((len(examples), self._seq_len), self._pad_id, dtype=torch.long)
        labels = torch.full((len(examples), self._seq_len), IGNORE_INDEX, dtype=torch.long)
        packed = any(example.position_ids is not None for example in examples)
        positions = torch.arange(self._seq_len).repeat(len(examples), 1) if packed else None
        tokens = 0
        for row, example in enumerate(examples):
            length = len(example.input_ids)
            input_ids[row, :length] = torch.tensor(example.input_ids, dtype=torch.long)
            labels[row, :length] = torch.tensor(example.labels, dtype=torch.long)
            if example.position_ids is not None:
                positions[row, :length] = torch.tensor(example.position_ids, dtype=torch.long)
            tokens += length - example.padding
        batch = {"input_ids": input_ids, "labels": labels, "num_tokens": torch.tensor(tokens)}
        if positions is not None:
            batch["position_ids"] = positions
        return {**batch, **collate_media(examples, self._seq_len)}


def joined_batch(micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A pipeline step's inputs: the micro batches' ids, labels, packed positions and padding mask, one row after
    another (the schedule splits them into its microbatches again)."""
    keys = [key for key in ("input_ids", "labels", "position_ids", "attention_mask") if key in micro_batches[0]]
    return {key: torch.cat([batch[key] for batch in micro_batches]) for key in keys}


def _epoch_permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The same permutation on every rank and every run for ``(seed, epoch)``; a tensor (8 bytes per example, where a
    list of Python ints would take about 36)."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(size, generator=generator)


class PrefetchingLoader:
    """A loader whose next global batch is built in a background thread while the current step runs, so that
    reading (prepared data: memory-mapped windows) never stalls a step. Its state is the state after the batches
    handed out, not the one prefetched, so a checkpoint resumes exactly where training stood."""

    def __init__(self, loader: DistributedBatchLoader) -> None:
        self._loader = loader
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="automodel-prefetch")
        self._next: Future | None = None
        self._state: dict | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self._loader.steps_per_epoch

    @property
    def grad_accumulation_steps(self) -> int:
        return self._loader.grad_accumulation_steps

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]:
        batch = self._loader.next_global_batch() if self._next is None else self._next.result()
        self._state = self._loader.state_dict()  # nothing in flight now
        self._next = self._pool.submit(self._loader.next_global_batch)
        return batch

    def state_dict(self) -> dict:
        return dict(self._state) if self._state is not None else self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._next is not None:
            self._next.result()
            self._next = None
        self._loader.load_state_dict(state)
        self._state = None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
