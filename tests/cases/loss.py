"""Rank-side cases for the fused linear cross-entropy and the gradient-sync choice of ``train_step`` (run inside
``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.runtime import full_tensor
from automodel.training.data import Example, pack_examples
from automodel.training.loop import train_step
from automodel.training.loss import FusedLinearCrossEntropy
from tests.tiny_models import VOCAB, tiny_config

CHUNK = 5  # divides neither the sequence nor the valid tokens: uneven chunks on every rank


def packed_micro_batches(context: MeshContext, *, rows: int = 8, seq_len: int = 16) -> list[dict[str, torch.Tensor]]:
    """This rank's micro batches (of 2) of a global batch of packed sequences: examples of random lengths whose
    prompt tokens carry no loss, concatenated to ``seq_len`` and padded (``pack_examples``), with the
    ``position_ids`` that restart per packed example (each example attends only to itself)."""
    generator = torch.Generator().manual_seed(5)
    examples = []
    for _ in range(rows * 3):
        length = int(torch.randint(3, seq_len // 2, (1,), generator=generator))
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        prompt = int(torch.randint(1, length, (1,), generator=generator))
        examples.append(Example(ids, [-100] * prompt + ids[prompt:]))
    packed = pack_examples(examples, seq_len, pad_id=0)[:rows]
    input_ids = torch.tensor([example.input_ids for example in packed])
    labels = torch.tensor([example.labels for example in packed])
    positions = torch.tensor([example.position_ids for example in packed])
    per_rank = rows // context.dp_size
    start = context.mesh("dp").get_local_rank() * per_rank
    mine = slice(start, start + per_rank)
    return [
        {"input_ids": ids[i : i + 2], "labels": targets[i : i + 2], "position_ids": where[i : i + 2]}
        for ids, targets, where in [(input_ids[mine], labels[mine], positions[mine])]
        for i in range(0, per_rank, 2)
    ]


def fused_loss_parity(layout: dict[str, Any], architecture: str, **config: Any) -> dict[str, Any]:
    """One training step's loss and every gradient (as full tensors) with the fused loss vs the model's own loss,
    on two identical parallelized models (``train_step``: token-weighted mean over the global batch)."""
    context = MeshContext.build(**layout)
    models = [
        NeMoAutoModelForCausalLM.from_config(tiny_config(architecture, **config), mesh_context=context, seed=3)
        for _ in range(2)
    ]
    for model in models:
        model.train()
    # One row per micro batch: every layout accumulates gradients over at least two micro batches.
    batches = [
        {key: value[i : i + 1] for key, value in pair.items()} for pair in packed_micro_batches(context) for i in (0, 1)
    ]
    plain = train_step(models[0], batches, context)
    fused = train_step(models[1], batches, context, FusedLinearCrossEntropy(CHUNK))
    head_weight = models[1].get_output_embeddings().weight
    head_grad_norm = full_tensor(head_weight.grad).norm().item()
    reference = dict(models[0].named_parameters())
    grads = {}
    for name, param in models[1].named_parameters():
        ours, theirs = param.grad, reference[name].grad
        if ours is None or theirs is None:
            grads[name] = 0.0 if ours is None and theirs is None else float("inf")
            continue
        grads[name] = (full_tensor(ours) - full_tensor(theirs)).abs().max().item()
    worst = max(grads, key=grads.__getitem__)
    with torch.no_grad():  # the model's own forward is untouched: full logits, every position
        logits = models[1](input_ids=batches[0]["input_ids"]).logits
    return {
        "loss": plain.item(),
        "micro_batches": len(batches),
        "loss_difference": (plain - fused).abs().item(),
        "grad": grads[worst],
        "worst_grad": worst,
        "grads": len(grads),
        "head_grad_norm": head_grad_norm,
        "head_placements": str(getattr(head_weight, "placements", "local")),
        "logits_shape": tuple(logits.shape),
        "input_shape": tuple(batches[0]["input_ids"].shape),
    }


def grad_sync_parity(layout: dict[str, Any], architecture: str = "llama") -> dict[str, Any]:
    """One ``train_step`` over two micro batches with ``grad_sync="step"`` and with ``"micro_batch"`` on two
    identical parallelized models: the loss and the largest gradient difference, and the gradient-sync flags each
    set before each micro batch (FSDP2's ``set_requires_gradient_sync``)."""
    context = MeshContext.build(**layout)
    models = [
        NeMoAutoModelForCausalLM.from_config(tiny_config(architecture), mesh_context=context, seed=3) for _ in range(2)
    ]
    flags: dict[str, list[bool]] = {}
    batches = packed_micro_batches(context)
    losses = {}
    for model, grad_sync in zip(models, ("step", "micro_batch"), strict=True):
        model.train()
        model.set_requires_gradient_sync = _recording(model.set_requires_gradient_sync, flags.setdefault(grad_sync, []))
        losses[grad_sync] = train_step(model, batches, context, grad_sync=grad_sync)
    reference = dict(models[0].named_parameters())
    grad = max(
        (full_tensor(param.grad) - full_tensor(reference[name].grad)).abs().max().item()
        for name, param in models[1].named_parameters()
    )
    return {
        "micro_batches": len(batches),
        "flags": flags,
        "loss_difference": (losses["step"] - losses["micro_batch"]).abs().item(),
        "grad": grad,
        "grad_norm": sum(full_tensor(p.grad).norm().item() for p in models[0].parameters()),
    }


def _recording(set_sync, recorded: list[bool]):
    def wrapper(sync: bool, *args: Any, **kwargs: Any) -> None:
        recorded.append(sync)
        set_sync(sync, *args, **kwargs)

    return wrapper
