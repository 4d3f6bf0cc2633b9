"""Checks of a pipeline stage on meta when it is built (``pipeline_stages.build_stage``): that its forward runs on
what it receives, and that the model's own init does not read another stage's parts. What fails here is refused
before anything is allocated, with the same message on every rank (the load agrees on the stages' refusals)."""

from __future__ import annotations

import torch
from torch import nn

from automodel._compat.torch import distribution_checks_off

from .meta_trace import FakeScalars, eager_experts, meta_twin

__all__ = ["check_stage_runs"]


def check_stage_runs(stage: nn.Module, whole: nn.Module, inputs: torch.Tensor, layers: range) -> None:
    """Run a meta twin of ``stage`` (cut from ``whole``, holding decoder ``layers`` and stand-ins for the other
    stages' parts) on ``inputs``, what it receives (meta), then the model's own init over it: a model whose forward or
    init reads a part another stage holds, or whose forward cannot take the received activation, is refused here,
    before anything is allocated, not in the first step. Raises ``ValueError`` naming the stage's layers."""
    twin = meta_twin(stage, shared=(whole,))
    eager_experts(twin)
    try:
        with torch.no_grad(), distribution_checks_off(), FakeScalars():
            twin.forward(inputs)
    except Exception as error:  # noqa: BLE001 - any failure of the stage's forward makes this split impossible
        message = str(error).splitlines()[0][:300] if str(error) else ""
        raise ValueError(
            f"{type(whole).__name__} cannot be split into pipeline stages: the stage of decoder layers "
            f"{layers.start}-{layers.stop - 1} fails in its forward ({type(error).__name__}: {message}): the "
            "model's forward reads a part another stage holds, or cannot start from the activation a stage "
            "receives. Use pp_size=1."
        ) from error
    _check_stage_init(twin, type(whole).__name__)


def _check_stage_init(twin: nn.Module, name: str) -> None:
    """Run the model's own ``_init_weights`` over the meta twin's modules (the load runs it for what a checkpoint does
    not hold): an init that reads a part another stage holds (FalconH1's walks every layer's mixer) is refused here,
    on every rank alike, not while one stage is filled."""
    owners: list[tuple[nn.Module, nn.Module]] = []

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if callable(getattr(module, "_init_weights", None)) else owner
        if owner is not None:
            owners.append((owner, module))
        for child in module.children():
            visit(child, owner)

    visit(twin, None)
    try:
        with torch.no_grad(), FakeScalars():
            for owner, module in owners:
                owner._init_weights(module)
    except AttributeError as error:
        if "_SkippedLayer" in str(error) or "_Absent" in str(error):
            raise ValueError(
                f"{name} cannot be split into pipeline stages: its `_init_weights` reads parts of other stages "
                f"({error}). Use pp_size=1."
            ) from error
    except Exception:  # noqa: BLE001, S110 - an init failing on meta for another reason says nothing of the split
        pass
