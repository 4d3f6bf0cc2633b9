"""The training losses: the model's own (``train.loss: model``) and a chunked cross-entropy that never materialises
the full logits (``train.loss: chunked``).

Both return the token-loss sum over the micro batch divided by ``num_items_in_batch``, as transformers'
``ForCausalLMLoss`` does (labels shifted left by one, ``-100`` ignored, logits upcast to fp32), so the training step's
token-weighted mean over the global batch is the same with either.

The chunked loss runs the model with its output head answering a one-token stand-in; the head's real input (the
final hidden states) is captured, and the head and the cross-entropy run over chunks of ``chunk_size`` tokens in one
autograd function that computes each chunk's gradients right away (the fused head-and-loss pattern of Liger's
``FusedLinearCrossEntropy``): a chunk's logits live only while it is processed, so activation memory for the loss is
one chunk's logits instead of the whole micro batch's (for a 128k vocabulary and 8k tokens, 4 GB in fp32 before the
backward pass doubles it). The forward of the model itself is untouched: generation and evaluation still get logits.

Placements are read from the head's weight: FSDP2 / HSDP shards are gathered (gradients reduce-scattered back and
averaged as FSDP averages them), and a vocabulary sharded over ``tp`` stays sharded (loss parallel: the softmax
statistics and the target logits are all-reduced over the TP group, never the logits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .data import IGNORE_INDEX

__all__ = ["ChunkedCrossEntropy", "LossFunction", "ModelLoss", "check_chunked_loss_support", "make_loss"]

TP_AXIS = "tp"

LossFunction = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor | None], torch.Tensor]

# Config attributes that transform the logits after the head (or add a loss term) in some transformers models: the
# chunked loss computes plain cross-entropy on the head's output, so it refuses these instead of silently differing.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_router_logits")


@dataclass(frozen=True)
class ModelLoss:
    """The model's own loss: ``model(**inputs, num_items_in_batch=n).loss`` (full logits)."""

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor], num_items: torch.Tensor | None):
        return model(**inputs, num_items_in_batch=num_items).loss


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """The head and the cross-entropy computed over chunks of ``chunk_size`` tokens; the full logits never exist.

    ``inputs`` are the model's keyword arguments with ``labels`` (shifted inside, as transformers does) or
    ``shift_labels`` (already shifted: context parallelism).
    """

    chunk_size: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive number of tokens.")

    def __call__(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], num_items: torch.Tensor | None
    ) -> torch.Tensor:
        check_chunked_loss_support(model)
        inputs = dict(inputs)
        labels, shift_labels = inputs.pop("labels", None), inputs.pop("shift_labels", None)
        if shift_labels is None:
            if labels is None:
                raise ValueError("The chunked loss needs `labels` (or `shift_labels`) in the model inputs.")
            shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        with _capture_head_input(model.get_output_embeddings()) as captured:
            model(**inputs)
        return self.from_head_input(model, captured[0], shift_labels, num_items)

    def from_head_input(
        self, model: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor, num_items: torch.Tensor | None
    ) -> torch.Tensor:
        """The loss from the output head's input ``hidden`` and the already shifted labels: what a pipeline's last
        stage hands over (``PipelinedModel.train_step(..., head_loss=loss.from_head_input)``)."""
        check_chunked_loss_support(model)
        if isinstance(hidden, DTensor):
            raise ValueError(
                f"train.loss=chunked: the output head received a DTensor ({hidden.placements}); the loss expects the "
                "whole sequence as a local tensor. Use train.loss=model for this layout."
            )
        head = model.get_output_embeddings()
        targets = shift_labels.to(hidden.device).reshape(-1)
        valid = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid)
        targets = targets.index_select(0, valid)
        if num_items is None:
            num_items = torch.tensor(float(max(len(valid), 1)), device=hidden.device)
        weight, bias, vocab = _local_head(head, hidden.dtype)
        scale = 1.0 / num_items.to(device=hidden.device, dtype=torch.float32)
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, scale, vocab, self.chunk_size)


def make_loss(kind: str, chunk_size: int) -> LossFunction:
    """The loss ``train.loss`` names: ``"model"`` or ``"chunked"`` (with ``train.loss_chunk_size``)."""
    if kind == "model":
        return ModelLoss()
    if kind == "chunked":
        return ChunkedCrossEntropy(chunk_size)
    raise ValueError(f"Unknown loss {kind!r}: use 'model' or 'chunked'.")


def check_chunked_loss_support(model: nn.Module) -> None:
    """Raise when the chunked loss would not compute the model's own loss: the head must be a linear layer whose
    output the model's forward returns as the logits, with no logit transform or extra loss term after it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = type(model).__name__
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"train.loss=chunked computes the output head itself, but {name}'s output embeddings are "
            f"{type(head).__name__} (a linear layer is needed; a LoRA adapter on the head is not supported). Use "
            "train.loss=model."
        )
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    transforms = [key for key in _LOGIT_TRANSFORMS if _changes_logits(getattr(text_config, key, None))]
    if transforms:
        raise ValueError(
            f"train.loss=chunked computes plain cross-entropy on the head's output, but {name}'s config sets "
            f"{', '.join(f'{key}={getattr(text_config, key)!r}' for key in transforms)}, which changes the logits or "
            "adds a loss term in the model's forward. Use train.loss=model for this model."
        )


def _changes_logits(value: Any) -> bool:
    """Whether a ``_LOGIT_TRANSFORMS`` setting is on (``None`` / ``False`` / a scale of 1 are off)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    return value != 1


@contextmanager
def _capture_head_input(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, the head's input is recorded and the head itself computes only the first position of it (the
    logits the forward returns are a throwaway stand-in)."""
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if isinstance(hidden, DTensor):
            raise ValueError(
                f"train.loss=chunked: the output head received a DTensor ({hidden.placements}); the loss expects the "
                "whole sequence as a local tensor. Use train.loss=model for this layout."
            )
        captured.append(hidden)
        return (hidden[..., :1, :], *args[1:])

    # Prepended: the head sees the input before the TP / FSDP hooks do.
    handle = head.register_forward_pre_hook(hook, prepend=True)
    try:
        yield captured
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"The output head ran {len(captured)} times in one forward; the chunked loss needs once.")


@dataclass(frozen=True)
class _Vocab:
    """The head's vocabulary as this rank holds it: rows ``[start, start + local size)``, all-reduced over ``group``
    when sharded (``None``: the whole vocabulary is local)."""

    start: int = 0
    group: dist.ProcessGroup | None = None


def _local_head(head: nn.Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, _Vocab]:
    """The head's weight and bias as local tensors in the compute dtype, and the vocabulary rows they hold."""
    weight, vocab = _local_parameter(head.weight)
    bias = _local_parameter(head.bias)[0] if head.bias is not None else None
    return weight.to(dtype), bias.to(dtype) if bias is not None else None, vocab


def _local_parameter(param: torch.Tensor) -> tuple[torch.Tensor, _Vocab]:
    """A head parameter with its data-parallel (FSDP / HSDP) shards gathered and its TP placement kept, as a local
    tensor whose gradient flows back to the parameter reduce-scattered and averaged over the data-parallel ranks (as
    FSDP2 averages); a plain tensor (unsharded, or FSDP's unsharded parameter during a step) is used as it is."""
    if not isinstance(param, DTensor):
        return param, _Vocab()
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    gathered, grads, vocab, data_parallel = [], [], _Vocab(), 1
    for dim, placement in enumerate(param.placements):
        if names[dim] == TP_AXIS:
            gathered.append(placement)
            grads.append(placement)
            if isinstance(placement, Shard):
                rows = -(-param.shape[placement.dim] // mesh.size(dim))  # torch.chunk's split
                vocab = _Vocab(mesh.get_local_rank(dim) * rows, mesh.get_group(dim))
            continue
        gathered.append(Replicate())
        grads.append(Partial())
        data_parallel *= mesh.size(dim)
    if data_parallel > 1:
        param = _ScaleGradient.apply(param, 1.0 / data_parallel)
    return param.redistribute(placements=gathered).to_local(grad_placements=grads), vocab


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` (FSDP's average, applied before its sum reduction)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(hidden @ weight.T + bias, targets)) * scale`` over chunks of rows, with the gradients of
    each chunk computed in the forward and only scaled by the incoming gradient in the backward.

    ``hidden``: ``[tokens, hidden]`` (valid tokens only), ``weight``: ``[local vocab, hidden]``, ``targets``: global
    vocabulary ids. With a vocabulary sharded over ``vocab.group``, the row maximum, the sum of exponentials and the
    target logit are all-reduced, and so is the hidden-state gradient (each rank's part covers its vocabulary rows).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, vocab: _Vocab, chunk_size: int):
        needs_grad = any(ctx.needs_input_grad[:3])
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        local_targets = targets - vocab.start
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            chunk = hidden[rows]
            logits = nn.functional.linear(chunk, weight, bias).float()
            chunk_loss, grad_logits = _chunk_cross_entropy(logits, local_targets[rows], vocab.group, needs_grad)
            total += chunk_loss
            del logits  # the chunk's logits live in grad_logits now (in place); freed before the next chunk's
            if grad_logits is None:
                continue
            grad_logits.mul_(scale)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
            grad_weight.addmm_(grad_logits.t(), chunk.float())
            grad_bias += grad_logits.sum(0)
            del grad_logits
        if grad_hidden is not None and vocab.group is not None:
            dist.all_reduce(grad_hidden, group=vocab.group)
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight.to(weight.dtype) if grad_weight is not None else torch.empty(0),
            grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else torch.empty(0),
        )
        ctx.has_bias = bias is not None
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype) if needs[0] else None,
            grad_weight * grad_output.to(grad_weight.dtype) if needs[1] else None,
            grad_bias * grad_output.to(grad_bias.dtype) if needs[2] and ctx.has_bias else None,
            None,
            None,
            None,
            None,
        )


def _chunk_cross_entropy(
    logits: torch.Tensor, local_targets: torch.Tensor, group: dist.ProcessGroup | None, needs_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed cross-entropy of one chunk of fp32 logits (this rank's vocabulary columns), and its gradient with
    respect to those logits (``softmax - one_hot``), computed in place in the logits' memory."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    here = (local_targets >= 0) & (local_targets < logits.shape[1])
    index = torch.where(here, local_targets, 0)
    maximum = logits.max(dim=-1).values
    if group is not None:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(maximum.unsqueeze(-1))
    target_logit = torch.where(here, logits[rows, index], 0.0)
    probabilities = logits.exp_()
    normalizer = probabilities.sum(dim=-1)
    if group is not None:
        both = torch.stack([normalizer, target_logit])
        dist.all_reduce(both, group=group)
        normalizer, target_logit = both[0], both[1]
    loss = (normalizer.log() - target_logit).sum()
    if not needs_grad:
        return loss, None
    probabilities.div_(normalizer.unsqueeze(-1))
    probabilities[rows[here], index[here]] -= 1.0
    return loss, probabilities
