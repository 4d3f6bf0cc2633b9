"""Copy checkpoint weights into an already-parallelized model, each rank reading only the slices it holds."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from automodel.distributed.megatron_fsdp import is_megatron_fsdp_parameter
from automodel.distributed.runtime import progress_bars_disabled

from .initialization import local_view
from .placements import checked_local_runs, local_indices
from .reader import parallel_reads
from .sources import Source, StoredTensor

__all__ = ["LoadReport", "Loaded", "count_reads", "load_into", "peak_rss_bytes", "state_tensors"]


@dataclass
class Loaded:
    """A parallelized, filled model (Megatron-FSDP's wrapper around it, under that strategy) and what its load did."""

    model: nn.Module
    report: LoadReport


@dataclass
class LoadReport:
    """What one rank's load did."""

    loaded: int = 0
    initialized: list[str] = field(default_factory=list)
    bytes_read: int = 0  # the bytes this rank's shards needed from the files
    bytes_spanned: int = 0  # the bytes read from the files (short runs close together are read with their gaps)
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    dequantized: str | None = None  # e.g. "14 tensors from fp8 (128x128 blocks)"

    def summary(self) -> str:
        """One log line: what was read, how long it took, peak host memory."""
        return (
            f"loaded {self.loaded} tensors ({self.bytes_read / 2**20:.1f} MiB read on this rank"
            + (f", {self.bytes_spanned / 2**20:.1f} MiB of file spans" if self.bytes_spanned > self.bytes_read else "")
            + f") in "
            f"{self.seconds:.2f} s, peak host memory {self.peak_rss_bytes / 2**30:.2f} GiB"
            + (f"; dequantized {self.dequantized}" if self.dequantized else "")
            + (f"; initialised {len(self.initialized)} missing" if self.initialized else "")
        )


def state_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (tied ones once) and persistent buffer, by state-dict name."""
    yield from model.named_parameters()
    non_persistent = set()
    for module_name, module in model.named_modules():
        non_persistent |= {f"{module_name}.{b}" if module_name else b for b in module._non_persistent_buffers_set}
    for name, buffer in model.named_buffers():
        if name not in non_persistent:
            yield name, buffer


def load_into(model: nn.Module, sources: dict[str, Source], *, progress: bool = True) -> int:
    """Read this rank's part of every tensor in ``sources`` and copy it (cast to the model's dtype) in place.

    The reads of safetensors files are planned tensor by tensor and done by the reader threads meanwhile
    (``reader.parallel_reads``: straight into host shards, through reused pinned buffers and a side stream into
    device shards); every read and copy is done when this returns. Shapes were checked by the caller. Returns the
    number of tensors loaded.
    """
    targets = [(name, tensor) for name, tensor in state_tensors(model) if name in sources]
    disable = progress_bars_disabled() if progress else True
    bar = tqdm(targets, desc="Loading weights", unit="tensor", disable=disable, leave=False)
    device = next((local_view(t).device for _, t in targets), torch.device("cpu"))
    with torch.no_grad(), parallel_reads(device):
        for name, tensor in bar:
            _read_local_part(sources[name], tensor, local_view(tensor))
    return len(targets)


def _read_local_part(source: Source, tensor: torch.Tensor, out: torch.Tensor) -> None:
    """Read this rank's part of ``tensor`` (a parameter or buffer) from ``source`` into ``out`` (its local storage,
    or a meta stand-in to count the reads): a stored tensor by its index runs, any other source by index vectors."""
    if isinstance(source, StoredTensor) and not is_megatron_fsdp_parameter(tensor):
        source.read_runs_into(checked_local_runs(tensor), out)
    else:
        source.read_into(local_indices(tensor), out)


def count_reads(model: nn.Module, sources: dict[str, Source]) -> int:
    """The bytes :func:`load_into` would read from the checkpoint files for this rank's shards of ``model`` (still
    on the meta device): the same read plan, walked without reading (``automodel.plan``)."""
    files = {id(source.files): source.files for source in _stored_parts(sources.values())}
    before = sum(f.bytes_read for f in files.values())
    with torch.no_grad():
        for name, tensor in state_tensors(model):
            if name in sources:
                _read_local_part(sources[name], tensor, torch.empty_like(local_view(tensor), device="meta"))
    return sum(f.bytes_read for f in files.values()) - before


def _stored_parts(sources) -> list:
    parts = []
    for source in sources:
        if hasattr(source, "files"):
            parts.append(source)
        parts.extend(_stored_parts(getattr(source, "parts", [])))
    return parts


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
