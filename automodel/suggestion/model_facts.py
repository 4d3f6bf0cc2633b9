"""What the layout search needs to know of a model, read once off the model built on the meta device: the sizes its
size rules check (heads, KV heads, experts, decoder layers), the parameter elements of each decoder layer (the ones
TP shards, the ones it keeps whole, the routed experts) and of the parts around the layers, and the dimensions of its
FLOPs and activations.

Nothing here is parallelized: the search prices thousands of layouts from these numbers, and only the survivors are
built and parallelized for real (``automodel.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from automodel.activation_estimate import mlp_width
from automodel.distributed.expert_parallel import expert_module_names
from automodel.distributed.model_structure import (
    attention_head_counts,
    decoder_layers,
    encoder_tower_blocks,
    output_embeddings,
)
from automodel.distributed.pipeline_stages import pipeline_roles

__all__ = ["LayerFacts", "ModelFacts", "model_facts"]


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer's parameter elements: ``sharded`` (matrices outside the routed experts, which TP splits),
    ``whole`` (vectors: norms and biases, which TP keeps whole on each rank) and ``experts`` (the routed experts)."""

    sharded: int
    whole: int
    experts: int

    @property
    def elements(self) -> int:
        """All of the layer's parameter elements."""
        return self.sharded + self.whole + self.experts


@dataclass(frozen=True)
class ModelFacts:
    """A model's sizes for the layout search (elements are parameter elements; see :func:`model_facts`)."""

    name: str
    text: PretrainedConfig
    layers: tuple[LayerFacts, ...]
    embedding: int  # the input embeddings (first pipeline stage)
    head: int  # the output head (last stage); the tied embedding's elements when tied (the last stage holds a copy)
    head_tied: bool  # without PP a tied head is the embedding itself: held once
    other: int  # everything else: the final norm, a vision tower ... (counted on the first stage, except the norm)
    heads: dict[str, int]  # {"num_attention_heads": .., "num_key_value_heads": ..} (what TP must divide)
    experts: int  # routed experts per experts module (0: none, or none in an expert-parallel plan)
    experts_per_token: int
    pipeline_refusal: str | None  # why the model cannot be split into pipeline stages (None: it can)

    @property
    def hidden(self) -> int:
        """The hidden size."""
        return self.text.hidden_size

    @property
    def vocab(self) -> int:
        """The vocabulary size."""
        return self.text.vocab_size

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    @property
    def attention_width(self) -> int:
        """Query heads x head dim: the width of the attention scores' contractions."""
        heads = self.text.num_attention_heads
        return heads * (getattr(self.text, "head_dim", None) or self.hidden // heads)

    @property
    def kv_width(self) -> int:
        """KV heads x head dim: the width of the keys (and of the values) context parallelism gathers."""
        kv_heads = getattr(self.text, "num_key_value_heads", None) or self.text.num_attention_heads
        return kv_heads * (self.attention_width // self.text.num_attention_heads)

    @property
    def mlp_width(self) -> int:
        """The MLP width a token passes through (the active experts' for a MoE)."""
        return mlp_width(self.text)

    @property
    def total(self) -> int:
        """Every parameter element once."""
        held_head = 0 if self.head_tied else self.head
        return sum(layer.elements for layer in self.layers) + self.embedding + held_head + self.other

    @property
    def expert_width(self) -> int:
        """One routed expert's MLP width (``moe_intermediate_size``, else ``intermediate_size``)."""
        return getattr(self.text, "moe_intermediate_size", None) or self.mlp_width

    def active_layer_elements(self, layer: LayerFacts) -> float:
        """The parameter elements one token multiplies through in ``layer``: its routed experts at
        ``top_k / experts``."""
        return layer.sharded + layer.whole + self.active_expert_elements(layer)

    def active_expert_elements(self, layer: LayerFacts) -> float:
        """The routed experts' elements one token multiplies through in ``layer`` (``top_k / experts`` of them)."""
        return layer.experts * self.experts_per_token / self.experts if self.experts else layer.experts


def model_facts(model: nn.Module) -> ModelFacts:
    """The facts of ``model`` (built on the meta device; never run or parallelized here, except the meta forward
    :func:`~automodel.distributed.pipeline_stages.pipeline_roles` runs on a twin to find the pipeline split)."""
    text = model.config.get_text_config()
    encoder = {id(block) for block in encoder_tower_blocks(model)}
    blocks = [block for block in decoder_layers(model) if id(block) not in encoder]
    expert_ids, experts = _experts(model)
    seen: set[int] = set()
    layers = []
    for block in blocks:
        sharded = whole = in_experts = 0
        for param in block.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            if id(param) in expert_ids:
                in_experts += param.numel()
            elif param.dim() >= 2:
                sharded += param.numel()
            else:
                whole += param.numel()
        layers.append(LayerFacts(sharded, whole, in_experts))
    embedding_module = model.get_input_embeddings()
    embedding = sum(p.numel() for p in embedding_module.parameters()) if embedding_module is not None else 0
    seen.update(id(p) for p in (embedding_module.parameters() if embedding_module is not None else ()))
    head_module = output_embeddings(model)
    head_params = list(head_module.parameters()) if head_module is not None else []
    head_tied = any(id(p) in seen for p in head_params)
    head = sum(p.numel() for p in head_params)
    seen.update(id(p) for p in head_params)
    other = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    try:
        pipeline_roles(model)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return ModelFacts(
        name=type(model).__name__,
        text=text,
        layers=tuple(layers),
        embedding=embedding,
        head=head,
        head_tied=head_tied,
        other=other,
        heads=attention_head_counts(model),
        experts=experts,
        experts_per_token=getattr(text, "num_experts_per_tok", None) or 0,
        pipeline_refusal=refusal,
    )


def _experts(model: nn.Module) -> tuple[set[int], int]:
    """The ids of the routed experts' parameters (of the modules the model's expert-parallel plan dispatches to) and
    the experts per module (as ``validate_experts`` counts them; the fewest, where modules differ)."""
    ids: set[int] = set()
    counts = []
    for name in expert_module_names(model):
        module = model.get_submodule(name)
        params = list(module.parameters())
        if not params:
            continue
        ids.update(id(p) for p in params)
        count = getattr(module, "num_experts", None)
        counts.append(count if count is not None else params[0].shape[0])
    return ids, min(counts) if counts else 0
