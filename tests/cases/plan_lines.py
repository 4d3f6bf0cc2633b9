"""What ``parallelize`` says on rank 0 for the parity architectures in five layouts, in one process simulating rank 0
of 4 under torch's fake process group (the model on meta): the lines the frozen plan's ``describe()`` must equal.

``python -m tests.cases.plan_lines`` writes them to ``tests/golden/parallelize_lines.json`` with the transformers and
torch versions they were recorded with (run on the code whose lines are the reference: the TP plans, and so some
lines, are transformers')."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from automodel._compat.torch import FakeStore
from automodel.distributed import MeshContext
from automodel.distributed.mesh import forget_meshes
from automodel.distributed.parallelizer import parallelizer_for
from tests.tiny_models import ARCHITECTURES, tiny_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "parallelize_lines.json"
WORLD_SIZE = 4
#: ``MeshContext.build`` keywords of the five layouts, on 4 simulated ranks.
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp2": {},
    "hsdp_ac": {"dp_replicate_size": 2, "activation_checkpointing": True},
    "tp2": {"tp_size": 2},
    "tp2_cp2_sp_selective": {
        "tp_size": 2,
        "cp_size": 2,
        "sequence_parallel": True,
        "activation_checkpointing": "selective",
    },
    "ep2_tp2": {"ep_size": 2, "tp_size": 2},
}


@contextlib.contextmanager
def simulated_rank_zero() -> Iterator[None]:
    """Rank 0 of ``WORLD_SIZE`` under torch's fake process group (collectives are no-ops)."""
    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE, store=FakeStore())
    try:
        yield
    finally:
        forget_meshes()
        dist.destroy_process_group()


def meta_model(architecture: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(architecture), dtype=torch.float32)


@contextlib.contextmanager
def captured_lines() -> Iterator[list[str]]:
    """The messages logged under ``automodel`` at INFO and above while the block runs."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, logger = _Keep(logging.INFO), logging.getLogger("automodel")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def parallelize_lines(architecture: str, layout: str) -> dict[str, Any]:
    """``{"lines": [...]}`` logged by ``parallelize``, or ``{"refused": "<class>: <message>"}``."""
    with simulated_rank_zero():
        model = meta_model(architecture)
        with captured_lines() as lines:
            try:
                context = MeshContext.build(**LAYOUTS[layout])
                parallelizer_for(model).parallelize(model, context)
            except (ValueError, NotImplementedError) as refusal:
                return {"refused": f"{type(refusal).__name__}: {refusal}"}
        return {"lines": list(lines)}


def main() -> None:
    import transformers

    found = {
        f"{architecture}/{layout}": parallelize_lines(architecture, layout)
        for architecture in ARCHITECTURES
        for layout in LAYOUTS
    }
    GOLDEN.parent.mkdir(exist_ok=True)
    recorded = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "cases": found}
    GOLDEN.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"{len(found)} cases written to {GOLDEN}")


if __name__ == "__main__":
    main()
