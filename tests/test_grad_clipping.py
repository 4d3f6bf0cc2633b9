"""Gradient clipping and foreach optimizers in a hand-written loop: ``torch.nn.utils.clip_grad_norm_`` + AdamW
(foreach) on TP, FSDP2 x TP, FSDP2 and HSDP (every parameter a DTensor on one mesh), and ``automodel.clip_grad_norm_``
on every layout, EP included, give the same step as the plain model in one process (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.cases.clipping import clipped_step_parity

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
# Adam's first step is lr * g / (|g| + eps): a gradient near zero turns rounding noise (the EP all-to-all sums tokens in
# another order) into a visible weight difference, still far below the step size (1e-2).
EP_WEIGHT_TOLERANCE = 1e-4
DENSE = {
    "fsdp2_on_2": (2, {"strategy": "fsdp2"}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_x_tp2": (4, {"strategy": "fsdp2", "tp_size": 2}),
    "hsdp_x_tp2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2, "tp_size": 2}),
    "tp2_sp": (2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
}
# torch 2.11's in-place foreach ops leave a Partial DTensor unchanged, so its own clip_grad_norm_ (foreach by default)
# does not scale the gradients sequence parallelism leaves Partial (the norms' weights); torch 2.12 fixed it. On 2.11,
# automodel.clip_grad_norm_ and torch's with foreach=False are exact (README, "Supported versions").
FOREACH_SKIPS_PARTIAL = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)


def _assert_step(results: list[dict], weight_tolerance: float = TOLERANCE) -> None:
    for result in results:
        assert abs(result["norm"] - result["reference_norm"]) <= TOLERANCE * max(1.0, result["reference_norm"]), result
        assert result["reference_norm"] > 0.5, "the step must clip"
        assert result["weights"] <= weight_tolerance, result


@pytest.mark.parametrize(("world", "layout"), DENSE.values(), ids=DENSE.keys())
def test_torch_clip_grad_norm_and_foreach_adamw(request, world, layout):
    if FOREACH_SKIPS_PARTIAL and layout.get("sequence_parallel"):
        reason = f"torch {torch.__version__}: _foreach_mul_ leaves sequence parallelism's Partial gradients unscaled"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    results = request.getfixturevalue(f"ranks{world}").run(clipped_step_parity, layout, "llama", "torch")
    assert all(result["all_dtensors"] for result in results), "every parameter is a DTensor on the model's mesh"
    _assert_step(results)


@pytest.mark.parametrize(
    ("world", "layout", "architecture"),
    [
        *[(world, layout, "llama") for world, layout in DENSE.values()],
        (4, {"strategy": "fsdp2", "ep_size": 2}, "mixtral"),
        (4, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}, "mixtral"),
    ],
    ids=[*DENSE.keys(), "ep2", "ep2_x_tp2"],
)
def test_automodel_clip_grad_norm_on_every_layout(request, world, layout, architecture):
    results = request.getfixturevalue(f"ranks{world}").run(clipped_step_parity, layout, architecture, "automodel")
    _assert_step(results, EP_WEIGHT_TOLERANCE if "ep_size" in layout else TOLERANCE)
