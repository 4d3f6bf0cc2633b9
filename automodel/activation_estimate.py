"""The activation estimate of ``automodel plan`` and ``automodel plan --suggest``: the bytes one rank keeps for
backward, from the model's config and the layout's numbers alone (no model, no process group).

Both the planner (for a layout it has built) and the layout search (for thousands of layouts it has not) call
:func:`activation_bytes`, so a suggestion's activation figure is the one ``automodel plan`` prints for that layout.
``docs/plan.md`` gives the formula and what it leaves out.
"""

from __future__ import annotations

from transformers import PretrainedConfig

__all__ = ["activation_bytes", "mlp_width"]

#: Activation elements kept per token and layer, in units of the hidden size, by attention and the parts around it:
#: the two norms' inputs, normalized values and outputs (6), the attention's q / k / v outputs, its output and the
#: output projection's input (4). Measured on CPU (``tests/test_suggest.py``): 10 H + 4 I is within 2% of the memory
#: a step of a Llama keeps without checkpointing.
ATTENTION_TERMS = 10
#: Of those, the norms' (6 H): what sequence parallelism splits over the TP ranks, and what full activation
#: checkpointing of the attention and MLP submodules keeps (the norms sit outside them).
NORM_TERMS = 6
#: The MLP's, in units of its width: gate, up, the activation and their product. TP splits them; selective
#: checkpointing recomputes the activation and the product (2), keeping the matmul outputs.
MLP_TERMS = 4
SELECTIVE_RECOMPUTED_MLP_TERMS = 2
#: Bytes per logit: the model's loss upcasts the logits to fp32.
LOGIT_BYTES = 4


def mlp_width(text: PretrainedConfig) -> int:
    """The MLP width a token passes through: the active experts' (``top_k x moe_intermediate_size``, plus shared
    experts) for a MoE, else ``intermediate_size`` (``4 H`` when the config has none)."""
    experts_per_token = getattr(text, "num_experts_per_tok", None)
    moe_width = getattr(text, "moe_intermediate_size", None)
    if experts_per_token and moe_width:
        shared = getattr(text, "n_shared_experts", 0) or 0
        return (experts_per_token + shared) * moe_width
    return getattr(text, "intermediate_size", None) or 4 * text.hidden_size


def activation_bytes(
    text: PretrainedConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    tp_size: int,
    cp_size: int,
    sequence_parallel: bool,
    activation_checkpointing: bool | str,
    element_size: int,
    layers: int | None = None,
    in_flight: float = 1.0,
    logits_kept: float = 1,
) -> int:
    """Activation bytes one rank keeps for backward.

    Per token of the rank's sequence (``seq_len / cp``) and per decoder layer, in the compute dtype
    (``element_size`` bytes): ``10 H`` for attention and the norms around it (6 of them the norms', which sequence
    parallelism splits over the TP ranks) and ``4 I`` for the MLP (:func:`mlp_width`; TP splits them). Full
    activation checkpointing (of each layer's attention and MLP) keeps the norms' ``6 H``; selective checkpointing
    keeps all but the MLP's activation and product (``2 I``); both hold one layer's whole activations while it is
    recomputed. ``layers`` (default: all of the model's) are the rank's decoder layers, ``in_flight`` the micro
    batches whose activations it holds at once (a pipeline rank's in-flight microbatches), ``logits_kept`` the micro
    batches whose logits it holds, in fp32 (``V / tp`` per token).
    """
    hidden = text.hidden_size
    layers = text.num_hidden_layers if layers is None else layers
    tokens = micro_batch_size * -(-seq_len // cp_size)
    width = mlp_width(text) / tp_size
    norms = NORM_TERMS * hidden / (tp_size if sequence_parallel else 1)
    per_layer = tokens * element_size * (norms + (ATTENTION_TERMS - NORM_TERMS) * hidden + MLP_TERMS * width)
    if activation_checkpointing in (True, "full"):
        kept = in_flight * layers * tokens * element_size * norms + per_layer
    elif activation_checkpointing == "selective":
        recomputed = tokens * element_size * SELECTIVE_RECOMPUTED_MLP_TERMS * width
        kept = in_flight * layers * (per_layer - recomputed) + per_layer
    else:
        kept = in_flight * layers * per_layer
    logits = logits_kept * tokens * LOGIT_BYTES * text.vocab_size / tp_size
    return int(kept + logits)
