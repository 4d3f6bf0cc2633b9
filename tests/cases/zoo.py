"""Rank-side sweep over the causal-LM zoo (run inside ``tests.harness.RankPool`` workers).

``zoo_parity(model_types, layout)`` parallelizes the tiny model of each model type with the default
``ModelParallelizer`` for ``MeshContext.build(**layout)`` and compares logits, loss and every gradient with the plain
model on the same rank. Each model type gets its own result, so one failure does not end the batch.

Keeping the ranks in step: every rank runs the same steps on the same model, so nearly every failure happens on all
ranks at the same point, before the same collective. After each step (parallelize, forward + backward, comparison)
the ranks all-gather their outcome, and if any rank failed, every rank abandons that model type together (a rank
that succeeded would otherwise enter the next step's collectives alone and wait forever). A failure on some ranks
only *inside* a step, while the others wait in a collective of that step, cannot be recovered here: the waiting ranks
stay blocked until the pool's case timeout tears the group down, and the driver (``tests/test_zoo_sweep.py``) then
reruns that batch one model type per call to pin the culprit.
"""

from __future__ import annotations

import copy
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from automodel.distributed import MeshContext, ModelParallelizer
from tests.causal_lm_zoo import build_tiny_model, zoo_batch

_STEPS = ("parallelize", "forward", "compare")


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _describe(error: BaseException) -> dict[str, str]:
    """The exception type, the first lines of its message, and where it was raised (innermost frames in our code
    and in transformers / torch)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/automodel/" in f.filename or "/model_sidecars/" in f.filename]
    hf = [f for f in frames if "/transformers/" in f.filename]
    where = []
    for frame in [group[-1] for group in (ours, hf, frames) if group]:
        path = frame.filename
        for marker in ("/site-packages/", "/sweep/", "/main/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        where.append(f"{path}:{frame.lineno} in {frame.name}")
    return {
        "error": f"{type(error).__name__}: " + " | ".join(lines[:3])[:600],
        "error_type": type(error).__name__,
        "where": " <- ".join(reversed(dict.fromkeys(where))),
    }


def _in_step(outcome: dict[str, Any] | None) -> dict[str, Any] | None:
    """All-gather one step's outcome (``None``: success); the first failing rank's error, or ``None`` if none."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    for rank, value in enumerate(gathered):
        if value is not None:
            return {**value, "rank": rank, "failed_ranks": [r for r, v in enumerate(gathered) if v is not None]}
    return None


def _forward_backward(reference: torch.nn.Module, model: torch.nn.Module, context: MeshContext) -> dict[str, Any]:
    """Forward with labels and backward: the plain model on the whole batch, the parallel one on this rank's rows."""
    batch = zoo_batch()
    ref_out = reference(input_ids=batch, labels=batch)
    ref_out.loss.backward()

    dp_rank, dp_size = context.mesh("dp").get_local_rank(), context.dp_size
    rows = batch.shape[0] // dp_size
    local = slice(dp_rank * rows, (dp_rank + 1) * rows)
    out = model(input_ids=batch[local], labels=batch[local])
    out.loss.backward()
    return {"ref_out": ref_out, "out": out, "local": local, "dp_size": dp_size}


def _differences(reference, model, context, run: dict[str, Any]) -> dict[str, Any]:
    ref_out, out, local = run["ref_out"], run["out"], run["local"]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=context.mesh("dp").get_group())
    loss /= run["dp_size"]
    ref_params = dict(reference.named_parameters())
    grad_diffs: dict[str, float] = {}
    presence: list[str] = []
    for name, param in model.named_parameters():
        grad, ref_grad = _full(param.grad), ref_params[name].grad
        if grad is None and ref_grad is None:
            continue
        if grad is None or ref_grad is None:
            # FSDP may hand a zero gradient to a parameter the forward did not reach.
            present = grad if grad is not None else ref_grad
            if present.abs().max().item() == 0:
                continue
            presence.append(f"{name} (plain: {ref_grad is not None}, parallel: {grad is not None})")
            continue
        grad_diffs[name] = (grad - ref_grad).abs().max().item()
    worst = max(grad_diffs, key=grad_diffs.__getitem__) if grad_diffs else None
    logits = _full(out.logits).detach()
    ref_logits = ref_out.logits[local].detach()
    return {
        "logits": (logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else float("inf"),
        "loss": (loss - ref_out.loss.detach()).abs().item(),
        "grad": grad_diffs[worst] if worst else 0.0,
        "worst_grad": worst,
        "n_grads": len(grad_diffs),
        "n_ref_grads": sum(p.grad is not None for p in reference.parameters()),
        "grad_presence": presence[:5],
        "nan": bool(torch.isnan(logits).any()) or any(v != v for v in grad_diffs.values()),
        "same_class": isinstance(model, type(reference)),
        "divergent_replicated_grads": _divergent_replicated_grads(model, context),
    }


def _divergent_replicated_grads(model: torch.nn.Module, context: MeshContext) -> list[str]:
    """Replicated (plain tensor) parameters whose gradients differ between the TP ranks: a replicated parameter must
    get the same gradient everywhere, so these see only their rank's part (e.g. a norm or activation with parameters
    that runs on sharded activations, missing from the TP plan)."""
    if context.tp_size == 1:
        return []
    group = context.mesh("tp").get_group()
    names = []
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) or param.grad is None:
            continue
        mean = param.grad.detach().clone()
        dist.all_reduce(mean, group=group)
        mean /= context.tp_size
        if (param.grad - mean).abs().max().item() > 1e-6 * max(1.0, mean.abs().max().item()):
            names.append(name)
    return names


def _one(model_type: str, context: MeshContext, train: bool) -> dict[str, Any]:
    start = time.perf_counter()
    reference = model = run = None
    outcome: dict[str, Any] | None = None
    result: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for step in _STEPS:
        local: dict[str, Any] | None = None
        step_start = time.perf_counter()
        try:
            if step == "parallelize":
                reference = build_tiny_model(model_type, train=train)
                model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
            elif step == "forward":
                run = _forward_backward(reference, model, context)
            else:
                result = _differences(reference, model, context, run)
        except Exception as error:
            local = {"step": step, **_describe(error)}
        timing[step] = time.perf_counter() - step_start
        outcome = _in_step(local)
        timing[f"{step}_sync"] = time.perf_counter() - step_start - timing[step]
        if outcome is not None:
            break
    del reference, model, run
    seconds = time.perf_counter() - start
    if outcome is not None:
        return {"status": "error", **outcome, "seconds": seconds, "timing": timing}
    return {"status": "ok", **result, "seconds": seconds, "timing": timing}


def zoo_parity(
    model_types: list[str], layout: dict[str, Any], eval_mode: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """For each model type: ``{"status": "ok", logits/loss/grad max abs differences ...}`` or ``{"status": "error",
    "step", "error", "where", "rank" ...}`` (the first failing rank's exception, seen identically on every rank).

    The models of ``eval_mode`` are compared in eval mode (``tests.causal_lm_zoo.train_mode`` is False for them: the
    caller decides once instead of every rank rerunning the feasibility check).
    """
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    context = MeshContext.build(**layout)
    with warnings.catch_warnings():
        # FSDP2 warns on every forward of a unit returning a view; the parity check below is what tells whether a
        # gradient was lost.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        return {model_type: _one(model_type, context, model_type not in eval_mode) for model_type in model_types}
