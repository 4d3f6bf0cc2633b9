"""Rank-side sweep over the causal-LM zoo (run inside ``tests.harness.RankPool`` workers).

``zoo_parity(model_types, layout)`` saves the tiny model of each model type, loads it with
``NeMoAutoModelForCausalLM.from_pretrained`` for ``MeshContext.build(**layout)`` (so with the parallelizer the auto
classes use: a registered sidecar's, else the default ``ModelParallelizer``) and with plain transformers'
``from_pretrained``, checks that every parameter and buffer is exactly the plain model's, and compares logits, loss and
every gradient (``tests.parity``). Each model type gets its own result, so one failure does not end the batch.

Keeping the ranks in step: every rank runs the same steps on the same model, so nearly every failure happens on all
ranks at the same point, before the same collective. After each step (parallelize, forward + backward, comparison)
the ranks all-gather their outcome, and if any rank failed, every rank abandons that model type together (a rank
that succeeded would otherwise enter the next step's collectives alone and wait forever). A failure on some ranks
only *inside* a step, while the others wait in a collective of that step, cannot be recovered here: the waiting ranks
stay blocked until the pool's case timeout tears the group down, and the driver (``tests/test_zoo_sweep.py``) then
reruns that batch one model type per call to pin the culprit.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from automodel import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext, ModelParallelizer
from tests.causal_lm_zoo import build_tiny_model, zoo_batch
from tests.parity import compare_with_reference, tensor_differences

_STEPS = ("load", "exactness", "compare", "replicas")


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


def model_type_parity(
    model_type: str, context: MeshContext, train: bool = True, parallelizer: ModelParallelizer | None = None
) -> dict[str, Any]:
    """One model type's result (see :func:`zoo_parity`).

    Without ``parallelizer``, through the product's own entry point: the tiny model is saved with
    ``save_pretrained``, plain transformers' ``from_pretrained`` loads the reference, and
    ``NeMoAutoModelForCausalLM.from_pretrained(mesh_context=context)`` the parallel model (with the parallelizer its
    class carries); every parameter and buffer must then be exactly the reference's. With ``parallelizer``, a copy of
    the plain model is parallelized by it directly (no load, so no exactness step).
    """
    start = time.perf_counter()
    reference = model = None
    outcome: dict[str, Any] | None = None
    result: dict[str, Any] = {"tensor_differences": []}
    timing: dict[str, float] = {}
    with _shared_directory() as checkpoint:
        for step in _STEPS:
            local: dict[str, Any] | None = None
            step_start = time.perf_counter()
            try:
                if step == "load":
                    reference, model = _load_pair(model_type, context, train, parallelizer, checkpoint)
                elif step == "exactness":
                    if parallelizer is None:
                        result["tensor_differences"] = tensor_differences(reference, model)
                elif step == "compare":
                    result.update(compare_with_reference(reference, model, context, zoo_batch()))
                else:
                    result["divergent_replicated_grads"] = _divergent_replicated_grads(model, context)
            except Exception as error:
                local = {"step": step, **_describe(error)}
            timing[step] = time.perf_counter() - step_start
            outcome = _in_step(local)
            timing[f"{step}_sync"] = time.perf_counter() - step_start - timing[step]
            if outcome is not None:
                break
    del reference, model
    seconds = time.perf_counter() - start
    if outcome is not None:
        return {"status": "error", **outcome, "seconds": seconds, "timing": timing}
    return {"status": "ok", **result, "seconds": seconds, "timing": timing}


def _load_pair(
    model_type: str, context: MeshContext | None, train: bool, parallelizer: ModelParallelizer | None, checkpoint: str
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The plain reference model and the parallel one (see :func:`model_type_parity`)."""
    plain = build_tiny_model(model_type, train=train)
    if parallelizer is not None:
        return plain, parallelizer.parallelize(copy.deepcopy(plain), context)
    plain.save_pretrained(checkpoint)  # under a process group transformers writes on rank 0 only
    if dist.is_initialized():
        dist.barrier()
    reference = type(plain).from_pretrained(checkpoint, dtype=torch.float32).train(train)
    # Plain transformers' from_pretrained (without TP) makes every floating parameter trainable, also those the model
    # declares frozen (Marian's sinusoidal positions); ours keeps the declared flags, as transformers' TP loading does.
    declared = {name: param.requires_grad for name, param in plain.named_parameters()}
    for name, param in reference.named_parameters():
        param.requires_grad_(declared[name])
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context, dtype=torch.float32)
    frozen = [name for name, param in model.named_parameters() if param.requires_grad != declared[name]]
    if frozen:
        raise AssertionError(f"requires_grad differs from the model's declared flags: {frozen}")
    return reference, model.train(train)


@contextlib.contextmanager
def _shared_directory() -> Iterator[str]:
    """A temporary directory every rank of the default group sees (rank 0 makes and removes it; one host)."""
    if not dist.is_initialized():
        with tempfile.TemporaryDirectory() as directory:
            yield directory
        return
    made = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    shared = [made]
    dist.broadcast_object_list(shared, src=0)
    try:
        yield shared[0]
    finally:
        dist.barrier()
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def one_process_exactness(model_type: str) -> dict[str, Any]:
    """Without a mesh, in this process: every tensor of ``NeMoAutoModelForCausalLM.from_pretrained`` against plain
    transformers' ``from_pretrained`` of the same checkpoint (NaN-aware, exact), and the two losses on the zoo batch.
    ``{"error": ...}`` when either load fails."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as checkpoint:
        try:
            reference, model = _load_pair(model_type, None, False, None, checkpoint)
        except Exception as error:
            return _describe(error)
    batch = zoo_batch()
    with torch.no_grad():
        losses = [float(m(input_ids=batch, labels=batch).loss) for m in (reference, model)]
    return {"tensor_differences": tensor_differences(reference, model), "losses": losses}


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
        return {
            model_type: model_type_parity(model_type, context, model_type not in eval_mode)
            for model_type in model_types
        }


def default_versus_sidecar(model_type: str, layout: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The model type's result with the default ``ModelParallelizer()`` and with its registered sidecar's."""
    torch.set_num_threads(1)
    context = MeshContext.build(**layout)
    return {
        "default": model_type_parity(model_type, context, parallelizer=ModelParallelizer()),
        "sidecar": model_type_parity(model_type, context),
    }
