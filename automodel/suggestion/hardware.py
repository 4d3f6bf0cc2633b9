"""The machine a layout is suggested for: memory, compute rate and link bandwidths of one GPU, and the node size.

Every figure here is a constant of the cost model, listed in ``docs/plan.md`` ("The cost model"): vendors' data sheet
figures (dense bf16 FLOP/s without sparsity, HBM bandwidth, NVLink bandwidth one way per GPU) and a typical
InfiniBand link per GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["GPUS", "Hardware", "parse_bytes"]

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Hardware:
    """One GPU's memory (bytes), its dense bf16 peak (FLOP/s) and HBM bandwidth (bytes/s), the link bandwidth one way
    per GPU within a node (NVLink) and across nodes (the GPU's network link), in Gbit/s, GPUs per node, and whether
    communication overlaps compute."""

    name: str
    memory_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    intra_node_gbps: float
    inter_node_gbps: float
    nproc_per_node: int = 8
    #: Whether collectives run beside compute (GPUs: NCCL's kernels and copy engines while FSDP2 prefetches; CPU
    #: gloo: no, its collectives run on the cores that compute).
    overlaps_communication: bool = True

    def with_options(
        self,
        *,
        memory_bytes: int | None = None,
        intra_node_gbps: float | None = None,
        inter_node_gbps: float | None = None,
        nproc_per_node: int | None = None,
    ) -> Hardware:
        """This machine with the given figures replaced (``None`` keeps the preset's)."""
        changes = {
            "memory_bytes": memory_bytes,
            "intra_node_gbps": intra_node_gbps,
            "inter_node_gbps": inter_node_gbps,
            "nproc_per_node": nproc_per_node,
        }
        for key, value in changes.items():
            if value is not None and value <= 0:
                raise ValueError(f"{key}={value!r} must be positive.")
        return replace(self, **{key: value for key, value in changes.items() if value is not None})


#: ``--gpu`` presets. Memory is the marketed capacity (80 GB parts report about 79.6 GiB to CUDA; the search keeps
#: headroom below it, see ``memory.HEADROOM``); NVLink: 600 / 900 / 1,800 GB/s both ways per GPU (A100 / H100, H200
#: / B200), halved for one way; network: one 200 Gbit/s HDR (A100 systems) or 400 Gbit/s NDR InfiniBand link per GPU.
GPUS: dict[str, Hardware] = {
    "a100-80g": Hardware("a100-80g", 80 * GIB, 312e12, 2.039e12, 300 * 8, 200),
    "h100": Hardware("h100", 80 * GIB, 989e12, 3.35e12, 450 * 8, 400),
    "h200": Hardware("h200", 141 * GB, 989e12, 4.8e12, 450 * 8, 400),
    "b200": Hardware("b200", 180 * GB, 2250e12, 8.0e12, 900 * 8, 400),
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GIB}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"141GB"``, ``"24 gib"`` or a number of bytes (``"85899345920"``, ``"1e9B"`` is not one), as bytes.
    A number without a unit below 1 MiB is refused: a GPU's memory written in GiB or GB without the unit."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size: write e.g. 80GiB, 141GB or 24GiB.")
    size = int(float(match.group(1)) * _UNITS[unit])
    if unit == "" and size < 2**20:
        raise ValueError(
            f"{text!r} has no unit and would be {size} bytes: write e.g. {match.group(1)}GiB or {match.group(1)}GB."
        )
    return size
