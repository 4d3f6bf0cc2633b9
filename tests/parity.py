"""The one parity comparison of the test cases: a parallelized model against the same model in one plain process.

Both run forward and backward in fp32; the parallel model sees its data-parallel rank's rows of the batch. The
result holds the largest absolute differences of the outputs, the loss and every gradient (``full_tensor()`` of the
sharded ones), plus facts the tests assert on (which parameters got no gradient, the class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.distributed import MeshContext
from automodel.distributed.runtime import full_tensor

Batch = torch.Tensor | dict[str, torch.Tensor]
LossFn = Callable[[Any], torch.Tensor]


def causal_lm_loss(output: Any) -> torch.Tensor:
    """The model's own loss (the batch carries ``labels``)."""
    return output.loss


def compare_with_reference(
    reference: nn.Module,
    model: nn.Module,
    context: MeshContext,
    batch: Batch,
    *,
    loss_fn: LossFn | None = None,
    output_key: str = "logits",
    local_batch: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Run forward + backward on both models and return the largest absolute differences.

    ``batch`` is a tensor of token ids (a causal LM: ``labels`` are the ids themselves) or a dict of model inputs of
    batch size ``B`` (every value's first dimension). ``loss_fn`` turns an output into the scalar to back-propagate
    (default: the model's own loss); per-rank losses are averaged over ``dp``, as the data-parallel gradient is.
    ``local_batch`` is this rank's part of ``batch`` where it is not a slice of rows (e.g. a vision-language batch
    whose image patches have no batch dimension); the outputs are then compared on this rank's rows of the batch.
    """
    inputs = {"input_ids": batch, "labels": batch} if isinstance(batch, torch.Tensor) else dict(batch)
    loss_fn = loss_fn or causal_lm_loss
    ref_out = reference(**inputs)
    ref_loss = loss_fn(ref_out)
    ref_loss.backward()

    local = local_rows(context, next(iter(inputs.values())).shape[0])
    out = model(**(local_batch if local_batch is not None else {key: value[local] for key, value in inputs.items()}))
    loss = loss_fn(out)
    loss.backward()

    averaged = loss.detach().clone()
    dist.all_reduce(averaged, group=context.mesh("dp").get_group())
    averaged /= context.dp_size
    grads = gradient_differences(reference, model)
    outputs = full_tensor(getattr(out, output_key)).detach()
    expected = getattr(ref_out, output_key)[local].detach()
    same_shape = outputs.shape == expected.shape
    return {
        "logits": (outputs - expected).abs().max().item() if same_shape else float("inf"),
        "loss": (averaged - ref_loss.detach()).abs().item(),
        "nan": bool(outputs.isnan().any()) or grads["grad"] != grads["grad"],
        **grads,
        "same_class": isinstance(model, type(reference)),
        "has_generate": callable(getattr(model, "generate", None)),
        "has_save_pretrained": callable(getattr(model, "save_pretrained", None)),
    }


def local_rows(context: MeshContext, batch_size: int) -> slice:
    """This rank's rows of a global batch of ``batch_size`` (split evenly over ``dp``)."""
    rows = batch_size // context.dp_size
    start = context.mesh("dp").get_local_rank() * rows
    return slice(start, start + rows)


def gradient_differences(reference: nn.Module, model: nn.Module) -> dict[str, Any]:
    """The largest absolute gradient difference (and its parameter), the largest difference relative to its
    reference gradient's magnitude where that exceeds 1 (``grad_scaled``), the counts of parameters with a gradient on
    each side, the parameters without one (some get none by construction, e.g. an index-only router), and those whose
    gradient is present on one side only with a nonzero value (FSDP hands an all-zero gradient to a parameter the
    forward did not reach, which is no difference)."""
    ref_params = dict(reference.named_parameters())
    diffs: dict[str, float] = {}
    scaled: dict[str, float] = {}
    without: list[str] = []
    presence: list[str] = []
    for name, param in model.named_parameters():
        grad, ref_grad = full_tensor(param.grad) if param.grad is not None else None, ref_params[name].grad
        if grad is None:
            without.append(name)
        if grad is None or ref_grad is None:
            present = grad if grad is not None else ref_grad
            if present is not None and present.abs().max().item() != 0:
                presence.append(f"{name} (plain: {ref_grad is not None}, parallel: {grad is not None})")
            continue
        diffs[name] = (grad - ref_grad).abs().max().item()
        scaled[name] = diffs[name] / max(1.0, ref_grad.abs().max().item())
    worst = max(diffs, key=diffs.__getitem__) if diffs else None
    return {
        "grad": diffs[worst] if worst else 0.0,
        "grad_scaled": max(scaled.values(), default=0.0),
        "worst_grad": worst,
        "n_grads": sum(param.grad is not None for param in model.parameters()),
        "n_ref_grads": sum(param.grad is not None for param in ref_params.values()),
        "no_grad": without,
        "ref_no_grad": [name for name, param in ref_params.items() if param.grad is None],
        "grad_presence": presence,
    }


def worst(result: dict[str, Any]) -> float:
    """The largest of the output, loss and gradient differences of a comparison."""
    return max(result["logits"], result["loss"], result["grad"])


def tensor_differences(reference: nn.Module, model: nn.Module) -> list[str]:
    """Every parameter and buffer (by every name, tied aliases included) whose value in ``model`` (``full_tensor()``
    of a sharded one) is not exactly the reference's, NaN-aware; names either side lacks; and tied groups of the
    reference that ``model`` no longer shares. Collective when ``model`` is sharded (every rank, the same order)."""
    expected = {**dict(reference.named_parameters(remove_duplicate=False)), **dict(reference.named_buffers())}
    actual = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    differences = [f"{name} (missing)" for name in expected if name not in actual]
    differences += [f"{name} (extra)" for name in actual if name not in expected]
    for name, tensor in expected.items():
        if name in actual and not _exactly_equal(tensor.detach(), full_tensor(actual[name].detach())):
            differences.append(name)
    groups: dict[int, list[str]] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    for names in groups.values():
        present = [name for name in names if name in actual]
        if len({id(actual[name]) for name in present}) > 1:
            differences.append(f"{' = '.join(present)} (no longer tied)")
    return differences


def _exactly_equal(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    if expected.is_floating_point():
        nan = expected.isnan()
        return torch.equal(nan, actual.isnan()) and torch.equal(expected[~nan], actual[~nan])
    return torch.equal(expected, actual)
