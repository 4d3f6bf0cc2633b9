"""Blends of prepared sources (``data.blend: [{path, weight}, ...]``), with Megatron's semantics: the blended
sequence interleaves the sources deterministically so that every prefix of it holds each source at its weight (to
within about one sample per source), and each source's samples come in its own seeded order, epoch after epoch.

Megatron computes the interleave with a greedy loop in C++ over the whole run. Here item ``i`` is found in closed form,
so any item can be read without the ones before it (a resumed run starts where it stands): source 0 takes the
items where ``floor(w0 * i + 1/2)`` steps up (Bresenham's line: at most half an item from ``w0 * i`` at any prefix),
and the rest are split the same way among the other sources, one level per source.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .data import Example

__all__ = ["BlendedExamples", "blend_positions"]


def blend_positions(index: int, weights: Sequence[float]) -> tuple[int, int]:
    """``(source, its sample number)`` of item ``index`` of the blend of ``weights`` (normalised)."""
    total = float(sum(weights))
    remaining, local = 1.0, index
    for source, weight in enumerate(weights[:-1]):
        share = min(1.0, (weight / total) / remaining) if remaining > 0 else 0.0
        before = int(share * local + 0.5)
        after = int(share * (local + 1) + 0.5)
        if after > before:
            return source, before
        local -= before  # the item's place among the items of the sources after this one
        remaining -= weight / total
    return len(weights) - 1, local


class BlendedExamples(Sequence[Example]):
    """The blend of ``sources`` (each a sequence of examples) at ``weights``. Its length is one nominal pass (the
    sources' lengths summed); the batch loader reads it in its own order (``shuffle=False``) and past its length, as
    the sources cycle through their epochs."""

    def __init__(self, sources: Sequence[Sequence[Example]], weights: Sequence[float], seed: int) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("a blend needs one weight per source, and at least one source")
        self.sources, self.weights, self.seed = list(sources), [float(w) for w in weights], seed
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (epoch, its permutation)

    def __len__(self) -> int:
        return sum(len(source) for source in self.sources)

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        source, sample = blend_positions(index, self.weights)
        size = len(self.sources[source])
        epoch, position = divmod(sample, size)
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            cached = (epoch, _permutation(size, self.seed, source, epoch))
            self._orders[source] = cached
        return self.sources[source][int(cached[1][position])]

    def shares(self, items: int) -> list[float]:
        """Each source's share of the first ``items`` items (what the log reports)."""
        counts = [0] * len(self.sources)
        for index in range(items):
            counts[blend_positions(index, self.weights)[0]] += 1
        return [count / items for count in counts]


def _permutation(size: int, seed: int, source: int, epoch: int) -> torch.Tensor:
    digest = hashlib.sha256(f"blend:{seed}:{source}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(size, generator=generator)
