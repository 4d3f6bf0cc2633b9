"""The training losses: the model's own (``train.loss: model``) and the fused linear cross-entropy
(``train.loss: fused``), which never holds more than one chunk of logits.

Both return the token-loss sum over the micro batch divided by ``num_items_in_batch``, as transformers'
``ForCausalLMLoss`` does (labels shifted left by one, ``-100`` ignored, logits upcast to fp32), so the training step's
token-weighted mean over the global batch is the same with either.

The fused loss runs the model with its output head answering a one-token stand-in; the head's real input (the final
hidden states) is captured, and the head, the model's logit transform (soft-capping, a logit scale) and the
cross-entropy run over chunks of ``chunk_size`` tokens in one autograd function that computes each chunk's gradients
right away (``automodel.training.linear_cross_entropy``). For a 128k vocabulary and 8k tokens the full fp32 logits
are 4 GB before the backward pass doubles them; the fused loss holds one chunk's. The forward of the model itself is
untouched: generation and evaluation still get logits.

Placements are read from the head's weight: an FSDP2 unit kept unsharded after the forward (the default for the
head) is used as it is and FSDP reduces its gradient; a resharded FSDP2 / HSDP weight is gathered (its gradient
reduce-scattered back and averaged as FSDP averages); a vocabulary sharded over ``tp`` stays sharded (loss
parallel: each rank's log-sum-exp and target logit are combined over the TP group, never the logits).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from automodel._compat.torch import ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS
from automodel.distributed.pipeline_layout import ZERO_BUBBLE_SCHEDULES

from .data import IGNORE_INDEX
from .linear_cross_entropy import LogitTransform, Vocab, fused_linear_cross_entropy

__all__ = [
    "choose_loss",
    "FusedLinearCrossEntropy",
    "LossFunction",
    "ModelLoss",
    "check_fused_loss_support",
    "fused_schedule_refusal",
    "make_loss",
]

TP_AXIS = "tp"
# Tokens per chunk: the matrix products of a chunk (K = chunk) keep a GPU's tensor cores busy and the head's gradient
# is read and written once per chunk; one chunk of a 128k vocabulary is 2 GiB of fp32 logits.
DEFAULT_CHUNK_SIZE = 4096

LossFunction = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor | None], torch.Tensor]

# Config attributes of transformers models that change the logits after the head, and how (see ``LogitTransform``).
_LOGIT_TRANSFORMS = {"logit_scale": "multiply", "logits_scaling": "divide", "final_logit_softcapping": "softcap"}
# Config attributes that add a loss term to the model's own loss: the fused loss cannot compute it.
_EXTRA_LOSS_TERMS = ("output_router_logits",)


@dataclass(frozen=True)
class ModelLoss:
    """The model's own loss: ``model(**inputs, num_items_in_batch=n).loss`` (full logits).

    A MoE model's auxiliary router loss (``output_router_logits``: ``router_aux_loss_coef * aux_loss`` added to the
    loss) is a mean over the forward's tokens, not a token sum like the cross-entropy, so it counts ``aux_share`` of
    its value: the training step passes ``1 / micro batches``, so that the step's loss holds the micro batches' mean
    auxiliary loss (Megatron's micro-batch load balancing) rather than their sum."""

    aux_share: float = 1.0

    def __call__(self, model: nn.Module, inputs: dict[str, torch.Tensor], num_items: torch.Tensor | None):
        output = model(**inputs, num_items_in_batch=num_items)
        aux = getattr(output, "aux_loss", None)
        if aux is None or self.aux_share == 1.0 or output.loss is None:
            return output.loss
        coefficient = getattr(getattr(model, "module", model), "router_aux_loss_coef", 0.0)
        return output.loss - (1.0 - self.aux_share) * coefficient * aux.to(output.loss.device)


@dataclass(frozen=True)
class FusedLinearCrossEntropy:
    """The head, the logit transform and the cross-entropy over chunks of ``chunk_size`` tokens, each chunk's
    gradients computed in the forward; the full logits never exist and the backward does not recompute them.

    ``inputs`` are the model's keyword arguments with ``labels`` (shifted inside, as transformers does) or
    ``shift_labels`` (already shifted: context parallelism).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive number of tokens.")

    def __call__(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], num_items: torch.Tensor | None
    ) -> torch.Tensor:
        check_fused_loss_support(model)
        inputs = dict(inputs)
        labels, shift_labels = inputs.pop("labels", None), inputs.pop("shift_labels", None)
        if shift_labels is None:
            if labels is None:
                raise ValueError("The fused loss needs `labels` (or `shift_labels`) in the model inputs.")
            shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        with _capture_head_input(model.get_output_embeddings()) as captured:
            model(**inputs)
        return self.from_head_input(model, captured[0], shift_labels, num_items)

    def from_head_input(
        self, model: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor, num_items: torch.Tensor | None
    ) -> torch.Tensor:
        """The loss from the output head's input ``hidden`` and the already shifted labels: what a pipeline's last
        stage hands over (``PipelinedModel.train_step(..., head_loss=loss.from_head_input)``)."""
        transform = check_fused_loss_support(model)
        if isinstance(hidden, DTensor):
            raise ValueError(_DTENSOR_INPUT.format(placements=hidden.placements))
        weight, bias, vocab = _local_head(model.get_output_embeddings(), hidden.dtype)
        targets = shift_labels.to(hidden.device).reshape(-1)
        if num_items is None:  # the mean over the valid tokens, as a device tensor (no host synchronization)
            num_items = (targets != IGNORE_INDEX).sum().clamp(min=1)
        scale = 1.0 / num_items.to(device=hidden.device, dtype=torch.float32)
        return fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            bias,
            targets,
            scale,
            chunk_size=self.chunk_size,
            vocab=vocab,
            transform=transform,
        )


def choose_loss(
    kind: str, chunk_size: int, model: nn.Module, *, fused_refusal: str | None = None
) -> tuple[LossFunction, str]:
    """The loss ``train.loss`` names, for ``model``, and a line for the log saying which and why.

    ``"auto"`` (the default) is the fused loss wherever it computes the model's own loss exactly (measured faster
    than the model's loss and without its logits' memory: docs/performance.md, "Loss"), else the model's loss, the
    reason said. ``fused_refusal``: why the layout rules the fused loss out (Megatron-FSDP). The decision reads the
    whole model (a pipeline's meta copy), so every rank makes the same one.
    """
    if kind != "auto":
        return make_loss(kind, chunk_size), f"loss: {'fused' if kind == 'chunked' else kind}"
    reason = fused_refusal or fused_schedule_refusal(model)
    if reason is None:
        try:
            check_fused_loss_support(getattr(model, "whole_on_meta", model))
        except ValueError as refusal:
            reason = str(refusal)
    if reason is not None:
        return ModelLoss(), f"loss: model (auto; the fused loss is not exact here: {reason})"
    return FusedLinearCrossEntropy(chunk_size), f"loss: fused (auto), chunks of {chunk_size} tokens"


def fused_schedule_refusal(model: nn.Module) -> str | None:
    """Why a pipeline schedule rules the fused loss out on this torch, or None: a zero-bubble schedule runs a loss's
    backward a second time for the weights, which torch before 2.13 cannot do for a custom autograd function."""
    schedule = getattr(getattr(model, "layout", None), "schedule", None)
    if schedule in ZERO_BUBBLE_SCHEDULES and not ZERO_BUBBLE_RERUNS_CUSTOM_FUNCTIONS:
        return (
            f"layout.pp_schedule={schedule} runs the loss's backward twice (inputs, then weights), which torch "
            f"{torch.__version__} cannot do for the fused loss's autograd function (torch 2.13 can); use "
            "train.loss=model, or another schedule"
        )
    return None


def make_loss(kind: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> LossFunction:
    """The loss ``train.loss`` names: ``"model"`` or ``"fused"`` (with ``train.loss_chunk_size``). ``"chunked"``,
    the fused loss's name until it replaced the chunked one, is accepted with a warning for one release. For
    ``"auto"`` (which needs the model) see :func:`choose_loss`."""
    if kind == "model":
        return ModelLoss()
    if kind == "chunked":
        warnings.warn(
            "train.loss=chunked is now train.loss=fused (the fused linear cross-entropy replaced the chunked loss); "
            "the old name will be refused in the next release.",
            FutureWarning,
            stacklevel=2,
        )
        kind = "fused"
    if kind == "fused":
        return FusedLinearCrossEntropy(chunk_size)
    raise ValueError(f"Unknown loss {kind!r}: use 'model' or 'fused'.")


def check_fused_loss_support(model: nn.Module) -> LogitTransform:
    """The logit transform the fused loss applies to compute the model's own loss; raise where it cannot: the head
    must be a linear layer whose output the model's forward returns as the logits, transformed at most by one
    known scalar transform, with no extra loss term."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = type(model).__name__
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"train.loss=fused computes the output head itself, but {name}'s output embeddings are "
            f"{type(head).__name__} (a linear layer is needed; a LoRA adapter on the head is not supported). Use "
            "train.loss=model."
        )
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    extra = [key for key in _EXTRA_LOSS_TERMS if getattr(text_config, key, None)]
    if extra:
        raise ValueError(
            f"train.loss=fused computes the cross-entropy only, but {name}'s config sets "
            f"{', '.join(f'{key}={getattr(text_config, key)!r}' for key in extra)}, which adds a loss term in the "
            "model's forward. Use train.loss=model for this model."
        )
    transforms = {
        key: float(value)
        for key in _LOGIT_TRANSFORMS
        if (value := getattr(text_config, key, None)) is not None and not isinstance(value, bool) and value != 1
    }
    if len(transforms) > 1:
        raise ValueError(
            f"train.loss=fused applies one logit transform after the head, but {name}'s config sets "
            f"{', '.join(f'{key}={value!r}' for key, value in transforms.items())}, whose order the loss would have to "
            "guess. Use train.loss=model for this model."
        )
    return LogitTransform(**{_LOGIT_TRANSFORMS[key]: value for key, value in transforms.items()})


_DTENSOR_INPUT = (
    "train.loss=fused: the output head received a DTensor ({placements}); the loss expects the whole sequence as a "
    "local tensor. Use train.loss=model for this layout."
)


@contextmanager
def _capture_head_input(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, the head's input is recorded and the head itself computes only the first position of it (the
    logits the forward returns are a throwaway stand-in)."""
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if isinstance(hidden, DTensor):
            raise ValueError(_DTENSOR_INPUT.format(placements=hidden.placements))
        captured.append(hidden)
        return (hidden[..., :1, :], *args[1:])

    # Prepended: the head sees the input before the TP / FSDP hooks do.
    handle = head.register_forward_pre_hook(hook, prepend=True)
    try:
        yield captured
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"The output head ran {len(captured)} times in one forward; the fused loss needs once.")


def _local_head(head: nn.Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, Vocab]:
    """The head's weight and bias as local tensors in the compute dtype, and the vocabulary rows they hold."""
    weight, vocab = _local_parameter(head.weight)
    bias = _local_parameter(head.bias)[0] if head.bias is not None else None
    return weight.to(dtype), bias.to(dtype) if bias is not None else None, vocab


def _local_parameter(param: torch.Tensor) -> tuple[torch.Tensor, Vocab]:
    """A head parameter with its data-parallel (FSDP / HSDP) shards gathered and its TP placement kept, as a local
    tensor whose gradient flows back to the parameter reduce-scattered and averaged over the data-parallel ranks (as
    FSDP2 averages); a plain tensor (unsharded, or FSDP's unsharded parameter during a step) is used as it is."""
    if not isinstance(param, DTensor):
        return param, Vocab()
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    gathered, grads, vocab, data_parallel = [], [], Vocab(), 1
    for dim, placement in enumerate(param.placements):
        if names[dim] == TP_AXIS:
            gathered.append(placement)
            grads.append(placement)
            if isinstance(placement, Shard):
                rows = -(-param.shape[placement.dim] // mesh.size(dim))  # torch.chunk's split
                vocab = Vocab(mesh.get_local_rank(dim) * rows, mesh.get_group(dim))
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
