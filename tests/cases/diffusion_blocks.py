"""Tiny random DiT and LTX-Video pipelines, whose transformers declare no ``_no_split_modules``, and the rank-side
case of ``NeMoAutoDiffusionPipeline`` for them (run inside ``tests.harness.RankPool`` workers).

Each pipeline is built from configs (2 transformer blocks, a tiny VAE; for LTX a tiny T5 encoder with a four-word
tokenizer) with every transformer parameter perturbed, and saved with ``save_pretrained``, the transformer in several
shards. The case loads it parallelized and compares the transformer's outputs and gradients with the plain
diffusers component.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLLTXVideo,
    DDIMScheduler,
    DiffusionPipeline,
    DiTPipeline,
    DiTTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import T5Config, T5EncoderModel, T5Tokenizer

from automodel.diffusion import NeMoAutoDiffusionPipeline
from automodel.distributed import MeshContext
from tests.parity import gradient_differences, local_rows

BATCH = 4  # one row per rank on 4 ranks
TEXT_DIM = 16  # the T5 width, LTX's caption and cross-attention width
TEXT_TOKENS = 5
FRAMES = HEIGHT = WIDTH = 2  # LTX latent video: 2 frames of 2 x 2 patches
DIT_LABELS = {0: "tabby cat", 1: "golden retriever, dog"}


def tiny_dit_transformer() -> DiTTransformer2DModel:
    """2 blocks, 2 heads of 8, 8 x 8 latents of 4 channels in 2 x 2 patches, 10 classes."""
    return DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,  # noise and variance, as DiT predicts
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )


def tiny_ltx_transformer() -> LTXVideoTransformer3DModel:
    """2 blocks, 2 heads of 8, 8 latent channels, captions of width ``TEXT_DIM``."""
    return LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=TEXT_DIM,
        num_layers=2,
        caption_channels=TEXT_DIM,
    )


def _perturbed(model: nn.Module) -> nn.Module:
    """``model`` with every parameter moved off its initial value (zero-initialized ones too), so a wrong slice
    shows."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def tiny_dit_pipeline(seed: int = 0) -> DiTPipeline:
    """A ``DiTPipeline`` with random weights: the transformer, a one-block VAE, a DDIM scheduler and two labels."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        sample_size=8,
    )
    pipe = DiTPipeline(
        transformer=_perturbed(tiny_dit_transformer()), vae=vae, scheduler=DDIMScheduler(), id2label=DIT_LABELS
    )
    # DiTPipeline keeps its labels out of its config; the hub's model_index.json holds them, as here (an entry of
    # the index that is not a component).
    pipe.register_to_config(id2label=DIT_LABELS)
    return pipe


def tiny_ltx_pipeline(seed: int = 0) -> LTXPipeline:
    """An ``LTXPipeline`` with random weights: the transformer, a 4-level VAE of 8 channels, a tiny T5 encoder with a
    four-word tokenizer and a flow-matching scheduler."""
    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4,
        patch_size=1,
        patch_size_t=1,
    )
    t5 = T5EncoderModel(
        T5Config(d_model=TEXT_DIM, d_ff=37, d_kv=8, num_heads=2, num_layers=2, vocab_size=100, decoder_start_token_id=0)
    )
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=t5,
        tokenizer=T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁a", -1.0)], extra_ids=0),
        transformer=_perturbed(tiny_ltx_transformer()),
    )


def _save(pipe: DiffusionPipeline, directory: Path) -> Path:
    """Save ``pipe``, its transformer only as safetensors shards with an index (no single file beside them)."""
    pipe.save_pretrained(directory)
    shutil.rmtree(directory / "transformer")
    pipe.transformer.save_pretrained(directory / "transformer", max_shard_size="20KB")
    return directory


def save_tiny_dit_pipeline(directory: Path) -> Path:
    """The tiny DiT pipeline saved in ``directory``."""
    return _save(tiny_dit_pipeline(), directory)


def save_tiny_ltx_pipeline(directory: Path) -> Path:
    """The tiny LTX-Video pipeline saved in ``directory``."""
    return _save(tiny_ltx_pipeline(), directory)


def dit_inputs(seed: int = 1) -> dict[str, Any]:
    """Fixed noisy latents, timesteps and class labels for ``BATCH`` images."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(BATCH, 4, 8, 8, generator=generator),
        "timestep": torch.tensor([1, 250, 500, 999]),
        "class_labels": torch.tensor([0, 1, 7, 10]),  # 10: the unconditional (dropped-label) class
    }


def ltx_inputs(seed: int = 1) -> dict[str, Any]:
    """Fixed packed latent videos, timesteps and prompt embeddings (two of them padded) for ``BATCH`` videos; the
    latent size goes as the ints the rotary embedding reads."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(BATCH, TEXT_TOKENS)
    mask[1:3, 3:] = 0
    return {
        "hidden_states": torch.randn(BATCH, FRAMES * HEIGHT * WIDTH, 8, generator=generator),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM, generator=generator),
        "timestep": torch.tensor([1.0, 250.0, 500.0, 999.0]),
        "encoder_attention_mask": mask,
        "num_frames": FRAMES,
        "height": HEIGHT,
        "width": WIDTH,
        "rope_interpolation_scale": (8 / 25, 32.0, 32.0),
    }


INPUTS: dict[str, Callable[[], dict[str, Any]]] = {"dit": dit_inputs, "ltx": ltx_inputs}


def _rows(inputs: dict[str, Any], rows: slice) -> dict[str, Any]:
    """``inputs`` cut to ``rows`` of the batch (the tensors; the ints and tuples are no batch)."""
    return {key: value[rows] if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def _squared_mean(transformer: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's output and the scalar back-propagated from it, ``mean(output ** 2)``."""
    output = transformer(**inputs, return_dict=False)[0]
    return output, output.pow(2).mean()


def blocks_parity(directory: str, model: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load the pipeline with its transformer parallelized for ``layout`` and compare the transformer with the plain
    diffusers one: outputs and the gradients of ``mean(output ** 2)``.

    The plain transformer sees the whole batch; each rank's parallel one its data-parallel rows, so that FSDP2's
    average of the per-rank gradients is the gradient of the whole batch's mean.
    """
    context = MeshContext.build(**layout)
    reference = DiffusionPipeline.from_pretrained(directory).transformer
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(
        directory, mesh_context=context, components_to_load=["transformer"]
    )
    transformer = pipe.transformer
    inputs = INPUTS[model]()
    expected, reference_loss = _squared_mean(reference, inputs)
    reference_loss.backward()
    rows = local_rows(context, BATCH)
    actual, loss = _squared_mean(transformer, _rows(inputs, rows))
    loss.backward()
    names = {module: name for name, module in transformer.named_modules()}
    return {
        "pipeline_class": type(pipe).__name__,
        "same_class": isinstance(transformer, type(reference)),
        "labels": sorted(getattr(pipe, "labels", {})),
        "units": [names[m] for m in transformer.modules() if isinstance(m, FSDPModule)],
        "checkpointed": [names[m] for m in transformer.modules() if getattr(m, "_automodel_checkpointed", False)],
        "on_meta": [name for name, param in transformer.named_parameters() if param.is_meta],
        "n_params": len(list(reference.parameters())),
        "output": (actual.detach() - expected.detach()[rows]).abs().max().item(),
        "output_scale": expected.abs().max().item(),
        "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None),
        **gradient_differences(reference, transformer),
    }
