"""Rank-side cases for the DiffusionGemma sidecar (run inside ``tests.harness.RankPool`` workers).

``DiffusionGemmaForBlockDiffusion`` has no causal-LM head and takes no labels: the encoder reads a prompt
(``input_ids``) into a KV cache and the decoder denoises a canvas (``decoder_input_ids``) against it, returning
logits over the canvas. Parity compares those logits and the gradients of ``mean(logits ** 2)``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from automodel.auto_model import NeMoAutoModel
from automodel.distributed import MeshContext, ModelParallelizer
from tests.hook_recorder import recording_hooks
from tests.parity import compare_with_reference

VOCAB = 96
PROMPT, CANVAS = 6, 4


def tiny_diffusion_gemma_config() -> DiffusionGemmaConfig:
    """Two MoE layers (sliding + full attention; 4 experts, top-2), 4 query / 2 KV heads, a one-layer vision tower."""
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=8,
        num_global_key_value_heads=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        position_embedding_size=16,
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=CANVAS,
        boi_token_id=VOCAB - 6,
        eoi_token_id=VOCAB - 5,
        image_token_id=VOCAB - 4,
    )


def save_diffusion_gemma_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny random DiffusionGemma in several shards; norms and router scales (ones at init) are randomised so that
    a wrong shard shows in the outputs."""
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_diffusion_gemma_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "scale", "per_expert_scale")) or "layernorm_" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, max_shard_size="40KB")
    return directory


def diffusion_batch(batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Deterministic prompts and canvases, the same on every rank (no pad, image or special ids)."""
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(1, VOCAB - 6, (batch_size, PROMPT), generator=generator),
        "decoder_input_ids": torch.randint(1, VOCAB - 6, (batch_size, CANVAS), generator=generator),
    }


def compare_outputs(reference: nn.Module, model: nn.Module, context: MeshContext) -> dict[str, Any]:
    """Forward + backward of ``mean(logits ** 2)`` on both models (the parallel one on its data-parallel rows)."""
    result = compare_with_reference(reference, model, context, diffusion_batch(), loss_fn=_mean_square_logits)
    return {**result, "class": type(model).__name__}


def _mean_square_logits(output: Any) -> torch.Tensor:
    return (output.logits**2).mean()


def fsdp_units(model: nn.Module) -> list[str]:
    """The FSDP units of ``model``: for each, the names of the modules it groups (innermost units first)."""
    names = {module: name for name, module in model.named_modules()}
    units: dict[int, list[str]] = {}
    for module, name in names.items():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), []).append(name)
    return sorted((",".join(unit) for unit in units.values()), key=lambda unit: (-unit.count("."), unit))


def loaded_parity(checkpoint: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load through ``NeMoAutoModel`` for ``layout`` and compare with plain transformers in one process (fp32)."""
    from model_sidecars.diffusion_gemma.model import DiffusionGemmaForBlockDiffusion as SidecarClass
    from model_sidecars.diffusion_gemma.parallelization import PARALLELIZER

    context = MeshContext.build(**layout)
    with recording_hooks(PARALLELIZER, "_apply_fsdp_sharding", "_fully_shard_module") as hooks:
        model = NeMoAutoModel.from_pretrained(checkpoint, mesh_context=context).train()
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint).train()
    result = compare_outputs(reference, model, context)
    embeddings = model.model.encoder.language_model.embed_tokens.weight
    return {
        **result,
        "sidecar": type(model).parallelizer is PARALLELIZER and isinstance(model, SidecarClass),
        "units": fsdp_units(model),
        "hooks": sorted(set(hooks)),
        "tied_head": model.lm_head.weight is embeddings and model.model.decoder.embed_tokens.weight is embeddings,
        "tied_layers": all(
            enc.experts.gate_up_proj is dec.experts.gate_up_proj and enc.mlp.up_proj.weight is dec.mlp.up_proj.weight
            for enc, dec in zip(model.model.encoder.language_model.layers, model.model.decoder.layers, strict=True)
        ),
        "rank": dist.get_rank(),
    }


def default_vs_sidecar(checkpoint: str, use_sidecar: bool) -> dict[str, Any]:
    """Parallelize plain transformers' model with the default ``ModelParallelizer()`` or the sidecar; its FSDP units
    and parity."""
    from model_sidecars.diffusion_gemma.parallelization import PARALLELIZER

    context = MeshContext.build("fsdp2")
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint).train()
    model = copy.deepcopy(reference)
    (PARALLELIZER if use_sidecar else ModelParallelizer()).parallelize(model, context)
    return {**compare_outputs(reference, model, context), "units": fsdp_units(model)}


def default_tp_plan_error(checkpoint: str) -> str | None:
    """What the default ``ModelParallelizer()`` says when asked for TP=2 with the model's own TP plan."""
    context = MeshContext.build("fsdp2", tp_size=2)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint)
    try:
        ModelParallelizer().parallelize(model, context)
    except ValueError as exc:  # refused before any collective, on every rank alike
        return str(exc)
    return None
