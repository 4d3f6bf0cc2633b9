"""A tiny random Flux pipeline, and the rank-side cases of ``NeMoAutoDiffusionPipeline`` (run inside
``tests.harness.RankPool`` workers).

The pipeline is built from configs (2 double- + 2 single-stream blocks, a one-block VAE, tiny CLIP and T5 text
encoders with four-word tokenizers; the cases pass prompt embeddings) and saved once per module with ``save_pretrained``; the
transformer in several shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from automodel.diffusion import NeMoAutoDiffusionPipeline, _load_parallelized
from automodel.distributed import MeshContext

JOINT_DIM = POOLED_DIM = 32
TEXT_TOKENS = 6
HEIGHT = WIDTH = 8  # pixels; the one-block VAE does not downsample, and Flux packs 2x2 latent patches


def tiny_flux_transformer() -> FluxTransformer2DModel:
    """2 double-stream + 2 single-stream blocks, 2 heads of 16."""
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=JOINT_DIM,
        pooled_projection_dim=POOLED_DIM,
        axes_dims_rope=(4, 4, 8),
    )


def tiny_flux_pipeline(seed: int = 0) -> FluxPipeline:
    """The whole pipeline with random weights; every transformer parameter is perturbed so a wrong slice shows."""
    torch.manual_seed(seed)
    transformer = tiny_flux_transformer()
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
        sample_size=32,
    )
    clip = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=POOLED_DIM,
            vocab_size=100,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            d_model=JOINT_DIM, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=100, decoder_start_token_id=0
        )
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=CLIPTokenizer(vocab={"<|startoftext|>": 0, "<|endoftext|>": 1, "a</w>": 2, "a": 3}, merges=[]),
        text_encoder_2=t5,
        tokenizer_2=T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁a", -1.0)], extra_ids=0),
        transformer=transformer,
    )


def save_tiny_flux_pipeline(directory: Path) -> Path:
    """Save the tiny pipeline (the transformer in several safetensors shards with an index) and return its folder."""
    pipe = tiny_flux_pipeline()
    pipe.save_pretrained(directory)
    pipe.transformer.save_pretrained(directory / "transformer", max_shard_size="40KB")
    return directory


def transformer_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    """Fixed latents, timestep and prompt embeddings for one transformer call (2 images of 4 packed patches)."""
    generator = torch.Generator().manual_seed(seed)
    patches = (HEIGHT // 2) * (WIDTH // 2)
    return {
        "hidden_states": torch.randn(2, patches, 4, generator=generator),
        "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, JOINT_DIM, generator=generator),
        "pooled_projections": torch.randn(2, POOLED_DIM, generator=generator),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_ids": torch.randn(patches, 3, generator=generator),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
    }


def denoising_step(pipe: DiffusionPipeline) -> torch.Tensor:
    """One denoising step of the whole pipeline from fixed prompt embeddings and noise, as packed latents."""
    generator = torch.Generator().manual_seed(2)
    prompt_embeds = torch.randn(1, TEXT_TOKENS, JOINT_DIM, generator=generator)
    pooled_prompt_embeds = torch.randn(1, POOLED_DIM, generator=generator)
    return pipe(
        prompt_embeds=prompt_embeds,
        pooled_prompt_embeds=pooled_prompt_embeds,
        num_inference_steps=1,
        height=HEIGHT,
        width=WIDTH,
        output_type="latent",
        generator=torch.Generator().manual_seed(3),
    ).images


def has_dtensor(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is sharded."""
    return any(isinstance(param, DTensor) for param in module.parameters())


def fsdp_parity(directory: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load the pipeline plainly and with its transformer parallelized; compare the transformer and one step."""
    context = MeshContext.build(**layout)
    reference = DiffusionPipeline.from_pretrained(directory)
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(
        directory, mesh_context=context, components_to_load=["transformer"]
    )
    inputs = transformer_inputs()
    with torch.no_grad():
        expected = reference.transformer(**inputs, return_dict=False)[0]
        actual = pipe.transformer(**inputs, return_dict=False)[0]
    step_expected, step_actual = denoising_step(reference), denoising_step(pipe)
    names = {module: name for name, module in pipe.transformer.named_modules()}
    others = ("vae", "text_encoder", "text_encoder_2")
    return {
        "pipeline_class": type(pipe).__name__,
        "transformer_is_flux": isinstance(pipe.transformer, FluxTransformer2DModel),
        "config_entry": list(pipe.config.transformer),
        "transformer_sharded": has_dtensor(pipe.transformer),
        "units": [names[m] for m in pipe.transformer.modules() if isinstance(m, FSDPModule)],
        "others_plain": {
            name: not has_dtensor(getattr(pipe, name)) and not isinstance(getattr(pipe, name), FSDPModule)
            for name in others
        },
        "on_meta": [n for n, p in pipe.transformer.named_parameters() if p.is_meta],
        "transformer_diff": (actual - expected).abs().max().item(),
        "transformer_scale": expected.abs().max().item(),
        "step_diff": (step_actual - step_expected).abs().max().item(),
        "step_shape": tuple(step_actual.shape),
    }


def tensor_parallel_error(directory: str) -> str:
    """The error a TP layout gives for Flux, whose diffusers TP plan uses a diffusers-only packed style."""
    context = MeshContext.build("fsdp2", tp_size=2)
    try:
        NeMoAutoDiffusionPipeline.from_pretrained(directory, mesh_context=context, components_to_load=["transformer"])
    except ValueError as error:
        return str(error)
    return ""


def save_tiny_qwen_image_transformer(directory: Path, seed: int = 0) -> Path:
    """A tiny random QwenImage transformer (2 blocks, 4 heads of 8), whose diffusers TP plan uses only transformers
    style names, in several shards. Its rotary tables are plain tensors computed at construction."""
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory


def qwen_image_parity(directory: str, layout: dict[str, Any]) -> dict[str, Any]:
    """The component path of ``NeMoAutoDiffusionPipeline`` (a whole QwenImage pipeline needs a Qwen2.5-VL text encoder,
    far from tiny) with TP from the class's own plan, against the unparallelized transformer."""
    context = MeshContext.build(**layout)
    reference = QwenImageTransformer2DModel.from_pretrained(directory)
    model = _load_parallelized(Path(directory), QwenImageTransformer2DModel, context, None)
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 16, 16, generator=generator),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=generator),
        "encoder_hidden_states_mask": torch.ones(2, 5),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_shapes": [[(1, 4, 4)]] * 2,
    }
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        actual = model(**inputs, return_dict=False)[0]
    attention = model.transformer_blocks[1].attn
    return {
        "to_q_tp": _tp_placement(attention.to_q.weight),
        "to_out_tp": _tp_placement(attention.to_out[0].weight),
        "diff": (actual - expected).abs().max().item(),
        "scale": expected.abs().max().item(),
    }


def _tp_placement(param: DTensor) -> str:
    return str(param.placements[param.device_mesh.mesh_dim_names.index("tp")])


def _transformer_output(transformer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in transformer_inputs().items()}
    with torch.no_grad():
        return transformer(**inputs, return_dict=False)[0].float()


def torch_dtype_parity(directory: str) -> dict[str, Any]:
    """diffusers' own ``torch_dtype`` keyword: every component in that dtype, the parallelized transformer included,
    and the transformer's output that of the plain bfloat16 pipeline."""
    context = MeshContext.build("fsdp2")
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(directory, mesh_context=context, torch_dtype=torch.bfloat16)
    reference = DiffusionPipeline.from_pretrained(directory, torch_dtype=torch.bfloat16)
    expected = _transformer_output(reference.transformer, torch.bfloat16)
    actual = _transformer_output(pipe.transformer, torch.bfloat16)
    return {
        "dtypes": {name: str(getattr(pipe, name).dtype) for name in ("transformer", "vae", "text_encoder")},
        "sharded": has_dtensor(pipe.transformer),
        "diff": (actual - expected).abs().max().item(),
        "scale": expected.abs().max().item(),
    }


def save_variant_pipeline(source: Path, directory: Path, *, legacy: bool = False) -> Path:
    """A copy of the pipeline at ``source`` whose transformer also has an ``fp16`` variant, in several shards with an
    index, with other weights (halved) than its plain files; no other component has the variant. ``legacy``: under
    diffusers' legacy variant names (``...-00001-of-00002.fp16.safetensors``, ``....safetensors.fp16.index.json``)."""
    shutil.copytree(source, directory)
    transformer = FluxTransformer2DModel.from_pretrained(directory / "transformer")
    with torch.no_grad():
        for param in transformer.parameters():
            param.mul_(0.5)
    folder = directory / "transformer"
    transformer.to(torch.float16).save_pretrained(folder, variant="fp16", max_shard_size="40KB")
    if legacy:
        index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.fp16.json").read_text())
        renamed = {}
        for shard in sorted(set(index["weight_map"].values())):  # diffusion_pytorch_model.fp16-00001-of-00002...
            stem = shard.removesuffix(".safetensors").replace(".fp16", "")
            renamed[shard] = f"{stem}.fp16.safetensors"
            (folder / shard).rename(folder / renamed[shard])
        index["weight_map"] = {key: renamed[shard] for key, shard in index["weight_map"].items()}
        (folder / "diffusion_pytorch_model.safetensors.index.fp16.json").unlink()
        (folder / "diffusion_pytorch_model.safetensors.fp16.index.json").write_text(json.dumps(index))
    return directory


def variant_parity(directory: str) -> dict[str, Any]:
    """``variant="fp16"``: the parallelized transformer holds the variant's weights, as diffusers loads them (the
    other components, without the variant, their plain files); a variant no component has is an error."""
    context = MeshContext.build("fsdp2")
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(directory, mesh_context=context, variant="fp16")
    reference = DiffusionPipeline.from_pretrained(directory, variant="fp16")
    plain = DiffusionPipeline.from_pretrained(directory)
    expected, actual = _transformer_output(reference.transformer), _transformer_output(pipe.transformer)
    try:
        NeMoAutoDiffusionPipeline.from_pretrained(directory, mesh_context=context, variant="bf16")
        missing = ""
    except ValueError as error:
        missing = str(error)
    return {
        "sharded": has_dtensor(pipe.transformer),
        "dtype": str(pipe.transformer.dtype),
        "reference_dtype": str(reference.transformer.dtype),
        "diff": (actual - expected).abs().max().item(),
        "diff_to_plain_weights": (actual - _transformer_output(plain.transformer)).abs().max().item(),
        "step_diff": (denoising_step(pipe) - denoising_step(reference)).abs().max().item(),
        "missing_variant": missing,
    }


def save_parity(directory: str, out: str) -> dict[str, Any]:
    """``save_pretrained`` of the pipeline with its transformer sharded, on every rank: plain diffusers loads the saved
    folder into the same pipeline; saved again in shards, the earlier single file is replaced. Unsupported arguments
    are refused on every rank before anything is written."""
    context = MeshContext.build("fsdp2")
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(directory, mesh_context=context)
    expected_step, expected = denoising_step(pipe), _transformer_output(pipe.transformer)
    refused_dir = Path(out) / "refused"
    try:
        pipe.save_pretrained(refused_dir, safe_serialization=False)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    refused_written = refused_dir.exists()
    pipe.save_pretrained(Path(out) / "single")
    sharded = Path(out) / "sharded"
    pipe.save_pretrained(sharded)
    pipe.save_pretrained(sharded, max_shard_size="40KB")  # replaces the single file with shards and their index
    pipe.save_pretrained(sharded, variant="fp16")  # beside the plain files, as diffusers writes a variant
    variant = DiffusionPipeline.from_pretrained(sharded, variant="fp16").transformer
    result: dict[str, Any] = {
        "refusal": refusal,
        "refused_written": refused_written,
        "variant_diff": (_transformer_output(variant) - expected).abs().max().item(),
    }
    for name in ("single", "sharded"):
        saved = Path(out) / name
        reloaded = DiffusionPipeline.from_pretrained(saved)
        result[name] = {
            "pipeline_class": type(reloaded).__name__,
            "transformer_class": type(reloaded.transformer).__name__,
            "config_class": json.loads((saved / "transformer" / "config.json").read_text())["_class_name"],
            "files": sorted(path.name for path in (saved / "transformer").iterdir()),
            "top": sorted(path.name for path in saved.iterdir()),
            "transformer_diff": (_transformer_output(reloaded.transformer) - expected).abs().max().item(),
            "step_diff": (denoising_step(reloaded) - expected_step).abs().max().item(),
        }
    return result
