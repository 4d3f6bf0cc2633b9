"""Lazy views of checkpoint tensors: read any index subset of a (possibly converted) tensor, touching only the bytes
that subset needs.

A model parameter maps to one ``Source``: a tensor stored in a safetensors file, or transformers' checkpoint
conversion of several stored tensors (experts stacked into one fused parameter, projections concatenated). Reading
this rank's indices of the composite reads only the matching slices of the stored tensors it is made of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .checkpoint_files import CheckpointFiles
from .placements import IndexRuns, to_runs

__all__ = ["Concatenated", "InMemoryTensor", "Source", "Stacked", "StoredTensor", "select"]


class Source(Protocol):
    """A global tensor that can be read at an index subset per dim."""

    shape: tuple[int, ...]

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        """The sub-tensor ``global[ix_(indices)]``, with dims in the order of ``indices``."""
        ...

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        """Write ``global[ix_(indices)]`` into ``out`` (cast to its dtype), with as few copies as possible."""
        ...

    def stored_keys(self) -> list[str]:
        """The checkpoint keys this tensor is built from."""
        ...


@dataclass
class StoredTensor:
    """One tensor of a checkpoint file, read by boxes (one run of indices per dim): positioned reads of their byte
    runs for safetensors, slices of the loaded file for ``.bin``."""

    files: CheckpointFiles
    key: str
    shape: tuple[int, ...]

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        dtype = self.files.dtype(self.key) if self.files.kind == "safetensors" else None
        if dtype is None:
            return self._read_runs([to_runs(dim_indices) for dim_indices in indices])
        out = torch.empty([len(dim_indices) for dim_indices in indices], dtype=dtype)
        self._read_runs_into([to_runs(dim_indices) for dim_indices in indices], out)
        return out

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        self.read_runs_into([to_runs(dim_indices) for dim_indices in indices], out)

    def read_runs_into(self, runs: IndexRuns, out: torch.Tensor) -> None:
        """:meth:`read_into` for the indices given as ascending runs ``(start, stop)`` per dim, in local order."""
        # `out` is a final destination: inside `reader.parallel_reads` its reads may be queued to the reader threads.
        self._read_runs_into(runs, out, defer=True)

    def _read_runs_into(self, runs: IndexRuns, out: torch.Tensor, *, defer: bool = False) -> None:
        """One box per combination of runs, each read straight into its part of ``out`` (through a temporary of
        that part's size where the part is not contiguous in ``out``), so memory never holds more than the shard
        and one part. ``defer``: reads into ``out`` itself may be queued (see ``CheckpointFiles.read_into``)."""
        split = next((dim for dim, dim_runs in enumerate(runs) if len(dim_runs) > 1), None)
        if split is None:
            slices = tuple(slice(*dim_runs[0]) if dim_runs else slice(0, 0) for dim_runs in runs)
            if out.is_meta:  # a plan: count what the read would take, read nothing
                self.files.count(self.key, slices)
            elif not out.is_contiguous():
                part = torch.empty(out.shape, dtype=out.dtype)
                self._read_runs_into(runs, part)  # read now: it is copied on at once
                out.copy_(part)
            elif not self.files.read_into(self.key, slices, out, defer=defer):
                out.copy_(self.files.read_slice(self.key, slices))
            return
        position = 0
        for run in runs[split]:
            count = run[1] - run[0]
            part = out.narrow(split, position, count)
            self._read_runs_into([*runs[:split], [run], *runs[split + 1 :]], part, defer=defer)
            position += count

    def _read_runs(self, runs: IndexRuns) -> torch.Tensor:
        split = next((dim for dim, dim_runs in enumerate(runs) if len(dim_runs) > 1), None)
        if split is None:
            slices = tuple(slice(*dim_runs[0]) if dim_runs else slice(0, 0) for dim_runs in runs)
            return self.files.read_slice(self.key, slices)
        pieces = [self._read_runs([*runs[:split], [run], *runs[split + 1 :]]) for run in runs[split]]
        return torch.cat(pieces, dim=split)

    def stored_keys(self) -> list[str]:
        return [self.key]


@dataclass
class Stacked:
    """``torch.stack(parts, dim)``: e.g. per-expert weights stacked into one fused expert parameter."""

    parts: list[Source]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = list(self.parts[0].shape)
        return tuple(inner[: self.dim] + [len(self.parts)] + inner[self.dim :])

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        rest = indices[: self.dim] + indices[self.dim + 1 :]
        return torch.stack([self.parts[i].read(rest) for i in indices[self.dim].tolist()], dim=self.dim)

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        rest = indices[: self.dim] + indices[self.dim + 1 :]
        for position, part in enumerate(indices[self.dim].tolist()):
            self.parts[part].read_into(rest, out.select(self.dim, position))

    def stored_keys(self) -> list[str]:
        return [key for part in self.parts for key in part.stored_keys()]


@dataclass
class Concatenated:
    """``torch.cat(parts, dim)``: e.g. gate and up projections packed into one ``gate_up_proj``."""

    parts: list[Source]
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(part.shape[self.dim] for part in self.parts)
        return tuple(shape)

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        pieces = [self.parts[part].read(part_indices) for part, part_indices, _, _ in self._pieces(indices)]
        return torch.cat(pieces, dim=self.dim)

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        for part, part_indices, position, count in self._pieces(indices):
            self.parts[part].read_into(part_indices, out.narrow(self.dim, position, count))

    def _pieces(self, indices: list[torch.Tensor]):
        """Runs of consecutive wanted indices owned by one part: (part, its indices, output position, count)."""
        bounds = torch.tensor([0] + [part.shape[self.dim] for part in self.parts]).cumsum(0)
        wanted = indices[self.dim]
        owner = torch.bucketize(wanted, bounds[1:], right=True).tolist()
        start = 0
        while start < len(wanted):
            stop = start
            while stop < len(wanted) and owner[stop] == owner[start]:
                stop += 1
            local = wanted[start:stop] - bounds[owner[start]]
            yield owner[start], [*indices[: self.dim], local, *indices[self.dim + 1 :]], start, stop - start
            start = stop

    def stored_keys(self) -> list[str]:
        return [key for part in self.parts for key in part.stored_keys()]


@dataclass
class InMemoryTensor:
    """A tensor already in memory (``from_config`` copies shards out of freshly initialised full weights)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        return select(self.tensor, indices)

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(self.read(indices))

    def stored_keys(self) -> list[str]:
        return []


def select(tensor: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """``tensor[ix_(indices)]`` (one ``index_select`` per dim that is not taken whole)."""
    for dim, dim_indices in enumerate(indices):
        if len(dim_indices) != tensor.shape[dim] or (len(dim_indices) and int(dim_indices[0]) != 0):
            tensor = tensor.index_select(dim, dim_indices)
    return tensor
