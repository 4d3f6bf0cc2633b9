"""The fused linear cross-entropy: ``sum(cross_entropy(transform(hidden @ weight.T + bias), targets)) * scale``
over chunks of rows, each chunk's gradients computed in the forward (Liger's ``FusedLinearCrossEntropy`` scheme).

A chunk's logits are computed, turned into their gradient in place (``softmax - one_hot``, times the row's weight,
through the logit transform), and multiplied straight into the gradients of the hidden states and of the
head; only then is the next chunk's computed. So at most one chunk of fp32 logits exists, and the backward pass only
scales the saved gradients by the incoming one: the logits are never recomputed.

What keeps it fast on a GPU:

- Every matrix product runs in the inputs' dtype (bf16 tensor cores in a bf16 model); only the softmax works on the
  logits upcast to fp32, as transformers' own loss does. With several chunks in a low-precision model, the head's
  gradient is summed over chunks in fp32 and rounded once, as a single matrix product would.
- Nothing waits on the device: ignored targets are masked (their rows get weight 0), not selected with a
  ``nonzero``, and the token count of a mean is a device tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn import functional

from .data import IGNORE_INDEX

__all__ = ["LogitTransform", "Vocab", "fused_linear_cross_entropy"]


@dataclass(frozen=True)
class LogitTransform:
    """What a model applies to its head's output before the loss, in transformers' order and ops.

    ``multiply``: Cohere's ``logit_scale`` (``logits * s``); ``divide``: Granite's ``logits_scaling``
    (``logits / s``); ``softcap``: Gemma's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``). At most one
    is set for a model (``check_fused_loss_support`` refuses more: their order would be a guess).
    """

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Transform fp32 ``logits`` in place; returns the soft-cap's derivative ``1 - tanh^2`` (or ``None``)."""
        if self.multiply is not None:
            logits.mul_(self.multiply)
        if self.divide is not None:
            logits.div_(self.divide)
        if self.softcap is None:
            return None
        tanh = logits.div_(self.softcap).tanh_()
        derivative = torch.mul(tanh, tanh).neg_().add_(1.0)
        tanh.mul_(self.softcap)
        return derivative

    @property
    def gradient_scale(self) -> float:
        """The scalar factor of the chain rule through ``apply_`` (the soft-cap's derivative is per element)."""
        return (self.multiply or 1.0) / (self.divide or 1.0)


@dataclass(frozen=True)
class Vocab:
    """The head's vocabulary as this rank holds it: rows ``[start, start + local size)``; with ``group`` set, the
    vocabulary is sharded over that group (tensor parallelism) and the softmax statistics are combined over it."""

    start: int = 0
    group: dist.ProcessGroup | None = None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    scale: torch.Tensor,
    *,
    chunk_size: int,
    vocab: Vocab = Vocab(),  # noqa: B008 - frozen, immutable
    transform: LogitTransform = LogitTransform(),  # noqa: B008 - frozen, immutable
    compiled: bool | None = None,
) -> torch.Tensor:
    """``sum over valid rows of cross_entropy(transform(hidden @ weight.T + bias), targets) * scale``.

    ``hidden``: ``[tokens, hidden size]``; ``weight``: ``[local vocabulary, hidden size]``; ``targets``: global
    vocabulary ids, ``IGNORE_INDEX`` where a token carries no loss; ``scale``: a 0-d tensor (``1 / num_items``).
    A soft-capped model runs chunks of ``chunk_size // 2`` rows: the cap's derivative is held beside the logits.

    ``compiled`` (default: on CUDA): each chunk's softmax, loss and logit gradient run as one ``torch.compile``d
    function of the chunk's logits in the inputs' dtype, which reads them twice and writes their gradient once,
    where the eager steps pass over fp32 copies about ten times. Not under a sharded vocabulary (its statistics are
    combined between the passes).
    """
    rows = max(chunk_size // 2, 1) if transform.softcap is not None else chunk_size
    if compiled is None:
        compiled = hidden.is_cuda
    chunk_fn = _compiled_softmax_cross_entropy() if compiled and vocab.group is None else None
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, scale, vocab, rows, transform, chunk_fn)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The forward computes the loss and every gradient chunk by chunk; the backward scales them."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, scale, vocab: Vocab, chunk_size: int, transform: LogitTransform, chunk_fn
    ):
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        needs_grad = needs_hidden or needs_weight or needs_bias
        tokens = hidden.shape[0]
        # Ignored rows keep their place and get weight 0: no data-dependent shapes, so no host synchronization.
        row_weight = (targets != IGNORE_INDEX).to(torch.float32) * scale.to(torch.float32)
        local_targets = targets - vocab.start
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = _ChunkSum(weight, several=tokens > chunk_size) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            chunk = hidden[rows]
            weights = row_weight[rows]
            if chunk_fn is not None and needs_grad:
                losses, grad_logits, bias_part = chunk_fn(
                    functional.linear(chunk, weight, bias), local_targets[rows], weights, transform, needs_bias
                )
                total += (losses * weights).sum()
                if grad_bias is not None:
                    grad_bias += bias_part
                _accumulate(grad_logits, chunk, weight, rows, grad_hidden, grad_weight)
                del grad_logits
                continue
            # In the inputs' dtype (tensor cores), then upcast: the logits transformers' loss sees.
            logits = functional.linear(chunk, weight, bias).float()
            derivative = transform.apply_(logits)
            losses, grad_logits = _cross_entropy_(
                logits, local_targets[rows], weights * transform.gradient_scale if needs_grad else None, vocab.group
            )
            total += (losses * weights).sum()
            del logits  # now grad_logits (the same memory), freed before the next chunk's logits
            if grad_logits is None:
                continue
            if derivative is not None:
                grad_logits.mul_(derivative)
            del derivative
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            _accumulate(grad_logits.to(weight.dtype), chunk, weight, rows, grad_hidden, grad_weight)
            del grad_logits
        if grad_hidden is not None and vocab.group is not None:
            dist.all_reduce(grad_hidden, group=vocab.group)  # each rank's part covers its vocabulary rows
        # This function's own buffers (no input or output of it), kept on ctx rather than saved for backward: the
        # backward scales them in place (no second copy of the head's gradient), and a zero-bubble pipeline schedule
        # runs the backward twice (for the inputs, then for the weights), which saved tensors' version check forbids.
        ctx.grads = (
            grad_hidden,
            grad_weight.result() if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
        )
        ctx.scaled = False
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        if not ctx.scaled:  # scaled once: a second run of this backward (zero-bubble's weight pass) reuses them
            for grad in ctx.grads:
                if grad is not None:
                    grad.mul_(grad_output.to(grad.dtype))
            ctx.scaled = True
        grads = [grad if needed else None for grad, needed in zip(ctx.grads, ctx.needs_input_grad[:3], strict=True)]
        return (*grads, None, None, None, None, None, None)


def _accumulate(grad_logits, chunk, weight, rows, grad_hidden, grad_weight) -> None:
    """Multiply one chunk's logit gradient (in the weight's dtype) into the hidden states' and the head's gradients."""
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        grad_weight.add(grad_logits.t(), chunk)


def softmax_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grad_weights: torch.Tensor,
    transform: LogitTransform,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk, out of place (what ``torch.compile`` fuses): the per-row cross-entropy of ``transform(logits)``
    (computed in fp32), its gradient with respect to ``logits``, ``(softmax - one_hot) * weight`` through the
    transform, in ``logits``' dtype, and with ``bias_grad`` that gradient's column sums in fp32 (the bias's part,
    summed before rounding). Rows whose target is outside the vocabulary (ignored) get a finite loss."""
    values = logits.float()
    derivative = None
    if transform.multiply is not None:
        values = values * transform.multiply
    if transform.divide is not None:
        values = values / transform.divide
    if transform.softcap is not None:
        tanh = torch.tanh(values / transform.softcap)
        derivative = 1.0 - tanh * tanh
        values = tanh * transform.softcap
    here = (targets >= 0) & (targets < values.shape[1])
    index = torch.where(here, targets, 0).unsqueeze(-1)
    target_logit = torch.where(here, values.gather(1, index).squeeze(-1), 0.0)
    maximum = values.amax(dim=-1, keepdim=True)
    exponentials = torch.exp(values - maximum)
    normalizer = exponentials.sum(dim=-1)
    losses = normalizer.log() + maximum.squeeze(-1) - target_logit
    scaled = grad_weights * transform.gradient_scale
    grad = exponentials * (scaled / normalizer).unsqueeze(-1)
    grad = grad.scatter_add(1, index, torch.where(here, -scaled, 0.0).unsqueeze(-1))
    if derivative is not None:
        grad = grad * derivative
    return losses, grad.to(logits.dtype), grad.sum(dim=0) if bias_grad else None


@functools.cache
def _compiled_softmax_cross_entropy():
    """``softmax_cross_entropy`` compiled once per process (the chunk length is dynamic after it first changes)."""
    return torch.compile(softmax_cross_entropy)


class _ChunkSum:
    """The head's gradient, ``sum over chunks of grad_logits.T @ chunk``, each product in the inputs' dtype.

    With one chunk it is that single product (what autograd computes for the model's own loss). With several chunks
    in a low-precision dtype the products are summed in fp32 and rounded once; in fp32 they are accumulated in place.
    """

    def __init__(self, weight: torch.Tensor, *, several: bool) -> None:
        self.weight, self.several = weight, several
        self.total: torch.Tensor | None = None

    def add(self, left: torch.Tensor, right: torch.Tensor) -> None:
        if self.total is None:
            product = torch.mm(left, right)
            self.total = product.float() if self.several else product
        elif self.total.dtype == left.dtype:
            self.total.addmm_(left, right)
        else:
            self.total += torch.mm(left, right)

    def result(self) -> torch.Tensor:
        """The sum in the weight's dtype (zeros when no token was seen)."""
        return torch.zeros_like(self.weight) if self.total is None else self.total.to(self.weight.dtype)


def _cross_entropy_(
    logits: torch.Tensor,
    local_targets: torch.Tensor,
    grad_weights: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row cross-entropy of one chunk of fp32 logits (this rank's vocabulary columns) and, with ``grad_weights``
    (one per row), its gradient with respect to them, ``(softmax - one_hot) * weight``, in place in the logits' memory.

    Rows whose target is ignored get a finite loss the caller weights by 0. Under a sharded vocabulary each rank's
    log-sum-exp and target logit are gathered over ``group`` (one collective per chunk) and combined. The passes over
    the chunk are few on purpose (a maximum, a subtraction, an exponential, a sum, one multiplication): on a GPU they
    are memory-bound and cost as much as the chunk's matrix products.
    """
    here = (local_targets >= 0) & (local_targets < logits.shape[1])
    index = torch.where(here, local_targets, 0).unsqueeze(-1)
    target_logit = torch.where(here, logits.gather(1, index).squeeze(-1), 0.0)
    maximum = logits.amax(dim=-1, keepdim=True)
    probabilities = logits.sub_(maximum).exp_()
    normalizer = probabilities.sum(dim=-1)
    local_lse = normalizer.log() + maximum.squeeze(-1)
    lse = local_lse
    if group is not None:
        lse, target_logit = _combine_over_vocabulary(local_lse, target_logit, group)
    losses = lse - target_logit
    if grad_weights is None:
        return losses, None
    # exp(logit - max) * exp(local_lse - lse) / normalizer = exp(logit - lse): the softmax over the whole vocabulary.
    factor = grad_weights / normalizer if group is None else grad_weights * torch.exp(local_lse - lse) / normalizer
    probabilities.mul_(factor.unsqueeze(-1))
    probabilities.scatter_add_(1, index, torch.where(here, -grad_weights, 0.0).unsqueeze(-1))
    return losses, probabilities


def _combine_over_vocabulary(
    local_lse: torch.Tensor, target_logit: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global log-sum-exp and target logit from every vocabulary shard's (the target is on one shard, the others
    contribute 0)."""
    local = torch.stack([local_lse, target_logit])
    gathered = local.new_empty((dist.get_world_size(group) * 2, local.shape[1]))  # gloo gathers along dim 0 only
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view(-1, *local.shape)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)
