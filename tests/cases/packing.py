"""Rank-side cases for packed SFT sequences (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from automodel import MeshContext, NeMoAutoModelForCausalLM
from automodel.distributed.context_parallel import gather_sequence
from automodel.distributed.runtime import full_tensor
from automodel.training.batches import DistributedBatchLoader
from automodel.training.data import Example, pack_examples
from automodel.training.loop import model_inputs
from automodel.training.packing import check_packed_attention
from tests.tiny_models import VOCAB

LENGTHS = (5, 7, 4)  # three examples, 16 tokens: one packed sequence, a multiple of 2 * cp_size


def _examples() -> list[Example]:
    generator = torch.Generator().manual_seed(5)
    examples = []
    for length in LENGTHS:
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        labels = [-100, -100] + ids[2:]  # a two-token "prompt" without loss, as SFT has
        examples.append(Example(ids, labels))
    return examples


def _batch(examples: list[Example], seq_len: int) -> dict[str, torch.Tensor]:
    loader = DistributedBatchLoader(
        examples,
        global_batch_size=len(examples),
        micro_batch_size=len(examples),
        dp_rank=0,
        dp_size=1,
        seq_len=seq_len,
        pad_id=0,
    )
    # The loader shuffles; put the rows back in order so that examples can be told apart.
    batch = loader.next_global_batch()[0]
    order = torch.argsort(torch.tensor([_first_id(row, examples) for row in batch["input_ids"].tolist()]))
    return {key: value[order] if value.dim() else value for key, value in batch.items()}


def _first_id(row: list[int], examples: list[Example]) -> int:
    return next(i for i, example in enumerate(examples) if row[: len(example.input_ids)] == example.input_ids)


def packed_vs_unpacked(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """The three examples packed into one sequence against the same three run as padded rows: per-example losses
    (summed token losses) and every gradient of the summed loss. Every rank runs the whole batch."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context).train()
    examples = _examples()
    seq_len = sum(LENGTHS)
    packed = pack_examples(examples, seq_len, pad_id=0)
    assert len(packed) == 1, "the three examples fill one sequence"
    check = check_packed_attention(model, context, tolerance=1e-4)
    runs = {}
    for name, batch in {"packed": _batch(packed, seq_len), "unpacked": _batch(examples, seq_len)}.items():
        # Before the forward: FSDP2 units kept unsharded after forward (the head) hold their gradient elsewhere.
        model.zero_grad(set_to_none=True)
        logits = _forward(model, context, batch)
        token_losses = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100, reduction="none"
        ).view(logits.shape[0], -1)
        per_example = _per_example(token_losses, batch, name)
        per_example.sum().backward()
        runs[name] = (per_example.detach(), {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()})
    (packed_losses, packed_grads), (unpacked_losses, unpacked_grads) = runs["packed"], runs["unpacked"]
    return {
        "check": check,
        "losses": (packed_losses - unpacked_losses).abs().max().item(),
        "grad": max((packed_grads[n] - unpacked_grads[n]).abs().max().item() for n in packed_grads),
        "n_losses": len(packed_losses),
    }


def _forward(model, context: MeshContext, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Whole-sequence fp32 logits of a batch, through the recipe's own input path (CP sharding included)."""
    inputs = model_inputs(batch, context, torch.device("cpu"))
    inputs.pop("labels"), inputs.pop("shift_labels", None)
    logits = full_tensor(model(**inputs).logits)
    return gather_sequence(logits, context.mesh("cp")) if context.cp_size > 1 else logits


def _per_example(token_losses: torch.Tensor, batch: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Each example's summed token loss (its targets only)."""
    if name == "unpacked":
        return token_losses.sum(dim=1)
    bounds = torch.tensor(LENGTHS).cumsum(0).tolist()
    starts = [0, *bounds[:-1]]
    # Token t predicts t + 1: example e's targets are its positions start+1 .. end-1, i.e. losses start .. end-2.
    return torch.stack([token_losses[0, start : end - 1].sum() for start, end in zip(starts, bounds, strict=True)])


def packing_error_for_causal_only_attention(checkpoint: str) -> str:
    """A model whose attention is causal over the whole row and ignores the packed mask (as a custom kernel or
    remote code may): the check refuses packing."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from automodel.training.packing import PackingNotSupportedError

    def causal_only(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("causal_only", causal_only)
    AttentionMaskInterface.register("causal_only", lambda *args, **kwargs: None)
    context = MeshContext.build("fsdp2")
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    model.set_attn_implementation("causal_only")
    try:
        check_packed_attention(model, context, tolerance=1e-3)
    except PackingNotSupportedError as error:
        return str(error)
    return "no error"
