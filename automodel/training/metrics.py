"""Throughput figures of the training log: tokens per second without padding, and a model-FLOPs-utilisation
estimate."""

from __future__ import annotations

from torch import nn

from automodel.distributed.expert_parallel import expert_module_names

__all__ = ["flops_per_token", "model_flops_utilization"]


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward: ``6 * N`` for the matmuls of the ``N`` parameters outside the
        input embedding (a lookup), plus ``12 * layers * hidden * seq_len`` for attention scores and values (the PaLM
        paper's estimate, Appendix B). Parameters are counted whole (``DTensor`` shapes are global); of routed experts only
    the share a token uses (``num_experts_per_tok`` of the experts) counts."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    lookups = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    head = model.get_output_embeddings()
    tied_head = head is not None and any(id(p) in lookups for p in head.parameters())
    counted = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    if tied_head:
        counted += sum(p.numel() for p in head.parameters())
    counted -= _inactive_expert_parameters(model, config)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * counted + 12.0 * layers * hidden * seq_len


def _inactive_expert_parameters(model: nn.Module, config) -> float:
    """The parameters of the routed experts (the modules the model's EP plan dispatches to) a token does not use."""
    names = expert_module_names(model)
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = next(
        (
            getattr(config, key)
            for key in ("num_experts", "num_local_experts", "n_routed_experts")
            if getattr(config, key, None)
        ),
        None,
    )
    if not names or not top_k or not experts:
        return 0.0
    modules = dict(model.named_modules())
    unique = {id(p): p.numel() for name in names for p in modules[name].parameters()}
    return sum(unique.values()) * (1 - top_k / experts)


def model_flops_utilization(
    tokens_per_second: float, flops_per_token: float, peak_tflops: float | None, devices: int
) -> float | None:
    """Achieved model FLOP/s over the peak of all ``devices`` (``peak_tflops`` each); ``None`` without a peak."""
    if not peak_tflops:
        return None
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12 * devices)
