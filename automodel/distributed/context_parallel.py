"""Context parallelism: the sequence is split over the ``cp`` ranks; attention all-gathers keys and values.

Each CP rank holds two chunks of every sequence (chunks ``r`` and ``2*cp - 1 - r`` of ``2*cp``), so causal attention
costs the same on every rank (load balancing). Attention runs through a transformers attention function registered
under :data:`CP_ATTENTION`: it all-gathers K/V over ``cp`` (autograd-aware: their gradients are reduce-scattered
back), and masks causally by the tokens' global positions, which the model receives as ``position_ids``. This runs on
gloo (CPU) and NCCL alike; torch's own ``context_parallel`` has no sharding rule for the CPU SDPA kernel.

The mask follows the documents the ``position_ids`` describe (a new one wherever they do not continue by one), so
packed sequences keep each example to itself on every shard; a padding ``attention_mask`` (sharded like the ids)
hides the padded keys, as transformers' own masks do. Supported: decoder layers whose attention goes through
transformers' attention interface, causal or bidirectional (the attention module's ``is_causal``), with logit
soft-capping (Gemma-2's ``softcap``), without sliding windows or attention sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface, AttentionMaskInterface

from automodel._compat.torch import all_gather, all_gather_autograd

from .model_structure import decoder_layers

__all__ = [
    "CP_ATTENTION",
    "apply_context_parallel",
    "check_context_parallel",
    "gather_sequence",
    "shard_batch_for_context_parallel",
]

CP_ATTENTION = "automodel_context_parallel"

IGNORE_INDEX = -100


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route ``model``'s attention through the CP kernel over ``cp_mesh`` (:func:`check_context_parallel` has
    refused blocks it cannot handle)."""
    for layer in decoder_layers(model):
        for module in layer.modules():
            module._automodel_cp_mesh = cp_mesh
    AttentionInterface.register(CP_ATTENTION, _context_parallel_attention)
    # The kernel builds its own mask from global positions; the model only hands it the padding of its keys.
    AttentionMaskInterface.register(CP_ATTENTION, _padding_only)
    model.set_attn_implementation(CP_ATTENTION)


def check_context_parallel(model: nn.Module) -> None:
    """Raise, naming the decoder layer and the fix, where the CP kernel cannot handle ``model``'s attention (no
    ``self_attn``, a sliding window, attention sinks). Touches nothing."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    sliding = getattr(text_config, "sliding_window", None) and (not layer_types or "sliding_attention" in layer_types)
    for index, layer in enumerate(decoder_layers(model)):
        name = f"decoder layer {index} ({type(layer).__name__})"
        if not hasattr(layer, "self_attn"):
            raise ValueError(f"Context parallelism cannot handle {name}: it has no `self_attn` attention block.")
        if sliding:
            raise ValueError(
                f"Context parallelism cannot handle {name}: its attention uses a sliding window "
                f"(sliding_window={text_config.sliding_window}). Use cp_size=1 for this model."
            )
        if any(param_name.endswith("sinks") for param_name, _ in layer.self_attn.named_parameters()):
            raise ValueError(f"Context parallelism cannot handle {name}: its attention has sinks. Use cp_size=1.")


def _padding_only(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers' mask builders hand the attention: this rank's ``[batch, local tokens]`` padding mask
    (True where a token is real), or None without one. Not dropped when this rank's part has no padding: the
    kernel gathers it over ``cp``, and the other ranks' parts may."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask.bool()


def _context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of the local queries against the whole sequence's keys and values: causal unless the module says
    otherwise, within each document, over the keys ``attention_mask`` (this rank's padding, :func:`_padding_only`)
    keeps, with Gemma-2's logit soft-capping when the layer passes ``softcap``."""
    mesh = module._automodel_cp_mesh
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(
            "Context parallelism needs the tokens' global `position_ids`: shard batches with "
            "automodel.distributed.context_parallel.shard_batch_for_context_parallel."
        )
    group = mesh.get_group()
    keys = all_gather_autograd(key.contiguous(), gather_dim=2, group=group)
    values = all_gather_autograd(value.contiguous(), gather_dim=2, group=group)
    positions = positions.expand(query.shape[0], -1)
    all_positions = all_gather(positions.contiguous(), gather_dim=1, group=group)
    causal = getattr(module, "is_causal", True)
    mask = _causal_document_mask(all_positions, mesh.size(), mesh.get_local_rank(), causal=causal)
    if attention_mask is not None:
        kept = all_gather(attention_mask.to(torch.uint8).contiguous(), gather_dim=1, group=group).bool()
        # Without the padded keys. A query left with none (a left pad) gets what transformers' attention gives it
        # under the same mask (SDPA: zeros).
        mask = mask & kept[:, None, None, :]
    dropout = dropout if module.training else 0.0
    softcap = kwargs.get("softcap")
    if softcap:
        output = _soft_capped_attention(query, keys, values, mask, scaling, dropout, softcap)
    else:
        output = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[1],
        )
    return output.transpose(1, 2).contiguous(), None


def _soft_capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    dropout: float,
    softcap: float,
) -> torch.Tensor:
    """transformers' eager attention with logit soft-capping (``softcap * tanh(scores / softcap)`` before the mask):
    SDPA has no soft-capping, so the scores are materialized, as Gemma-2's own eager attention does."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = query @ keys.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = F.dropout(F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), p=dropout)
    return weights @ values


def _chunk_order(cp_size: int, cp_rank: int) -> tuple[int, int]:
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _global_index(length: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """The sequence index of each of a CP rank's ``length`` local tokens (its two load-balanced chunks)."""
    chunk = length // 2
    first, second = _chunk_order(cp_size, cp_rank)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def _causal_document_mask(
    all_positions: torch.Tensor, cp_size: int, cp_rank: int, *, causal: bool = True
) -> torch.Tensor:
    """[batch, 1, local queries, all keys]: a query sees the keys at or before it in its own document (with
    ``causal=False``, every key of its document).

    ``all_positions`` are the model's ``position_ids`` gathered over ``cp`` (rank by rank). A document starts where
    the positions do not continue by one (transformers' packed-sequence rule), so a packed batch (positions restarting
    per example) gets a block-diagonal causal mask and an unpacked one a plain causal mask.
    """
    length = all_positions.shape[1] // cp_size
    index = torch.cat([_global_index(length, cp_size, rank, all_positions.device) for rank in range(cp_size)])
    in_order = torch.empty_like(all_positions)
    in_order[:, index] = all_positions
    starts = torch.diff(in_order, prepend=in_order[:, :1] - 1, dim=-1) != 1
    documents = starts.cumsum(-1)[:, index]  # back in gathered order
    mine = slice(cp_rank * length, (cp_rank + 1) * length)
    same_document = documents[:, mine, None] == documents[:, None, :]
    if causal:
        same_document = same_document & (index[mine][:, None] >= index[None, :])
    return same_document[:, None]


def shard_batch_for_context_parallel(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    cp_mesh: DeviceMesh,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """This CP rank's part of a causal-LM batch: ``input_ids``, ``position_ids``, ``shift_labels`` and, when given,
    the padding ``attention_mask``.

    Labels are shifted over the whole sequence first (the loss of the last token of one shard needs the first token
    of the next), so call the model as ``model(**batch, labels=batch["shift_labels"])``: transformers' causal-LM
    loss uses ``shift_labels`` as given. ``position_ids`` (default ``0, 1, 2, ...``) of a packed batch restart at 0
    for every packed example, and attention keeps each example to itself. The sequence length must be a multiple of
    ``2 * cp_size``.
    """
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    length = input_ids.shape[1]
    if length % (2 * cp_size):
        raise ValueError(
            f"Context parallelism splits each sequence into 2 * cp_size = {2 * cp_size} chunks, and the sequence "
            f"length {length} is not a multiple of it: pad the batch to a multiple of {2 * cp_size}."
        )
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device)
    batch = {"input_ids": input_ids, "position_ids": position_ids.expand(input_ids.shape[0], -1)}
    if labels is not None:
        batch["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    chunk = length // (2 * cp_size)
    first, second = _chunk_order(cp_size, cp_rank)
    return {
        name: torch.cat([t[:, first * chunk : (first + 1) * chunk], t[:, second * chunk : (second + 1) * chunk]], 1)
        for name, t in batch.items()
    }


def gather_sequence(local: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor (e.g. logits) from every CP rank's load-balanced part, in sequence order."""
    cp_size = cp_mesh.size()
    gathered = all_gather(local.contiguous(), gather_dim=seq_dim, group=cp_mesh.get_group())
    pieces = gathered.chunk(2 * cp_size, dim=seq_dim)  # rank r contributed pieces 2r and 2r+1
    ordered = [None] * (2 * cp_size)
    for rank in range(cp_size):
        first, second = _chunk_order(cp_size, rank)
        ordered[first], ordered[second] = pieces[2 * rank], pieces[2 * rank + 1]
    return torch.cat(ordered, dim=seq_dim)
