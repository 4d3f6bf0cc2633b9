"""Tiny quantized checkpoints in the exact on-disk layouts of the Hub's releases, written from tiny random models.

- Block-scaled FP8 (DeepSeek-V3, Qwen3 ``-FP8``, Kimi-K2): ``config.quantization_config = {"quant_method": "fp8",
  "weight_block_size": [128, 128], ...}``; each quantized ``*.weight`` is ``float8_e4m3fn`` with a float32
  ``*.weight_scale_inv`` holding one scale per block (``weight = codes * scale_inv``); fused experts store
  ``experts.gate_up_proj`` with ``experts.gate_up_proj_scale_inv`` (one grid per expert).
- MXFP4 (gpt-oss): ``quant_method == "mxfp4"``; each expert projection ``P`` [E, in, out] is stored transposed as
  ``P_blocks`` [E, out, in / 32, 16] (two E2M1 codes a byte, the even element in the low nibble) and ``P_scales``
  [E, out, in / 32] (E8M0 exponents, ``2 ** (byte - 127)``).

The writers return what the codes mean (the dequantized values) by model parameter name, and save the same model
holding those values unquantized beside the checkpoint (``dequantized_path``): the oracle every loader must
reproduce.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.tiny_models import build_model, tiny_config

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_MAX = 448.0  # largest float8_e4m3fn


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_inv)`` of ``weight`` ([..., rows, cols]): one scale per ``block`` of the last two dims
    (edge blocks are partial), or one for the whole tensor when ``block`` is None."""
    if block is None:
        scale = weight.abs().max().clamp(min=1e-12) / FP8_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(())
    *lead, rows, cols = weight.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = torch.zeros(*lead, grid_rows * block_rows, grid_cols * block_cols)
    padded[..., :rows, :cols] = weight
    blocks = padded.reshape(*lead, grid_rows, block_rows, grid_cols, block_cols)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., grid_rows, grid_cols]
    full_scale = scale.repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)[..., :rows, :cols]
    return (weight / full_scale).to(torch.float8_e4m3fn), scale.float()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """What ``codes`` * their block's scale mean, in float32."""
    if block is None:
        return codes.float() * scale.float()
    rows, cols = codes.shape[-2:]
    full = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    return codes.float() * full.float()


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blocks, scales, dequantized)`` of ``weight`` [E, in, out], stored transposed as gpt-oss stores it."""
    stored = weight.transpose(1, 2).contiguous()  # [E, out, in]
    experts, rows, cols = stored.shape
    groups = stored.reshape(experts, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4_VALUES).abs().argmin(-1).to(torch.uint8)  # nearest E2M1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    dequantized = FP4_VALUES[codes.long()] * torch.exp2(exponent).unsqueeze(-1)
    dequantized = dequantized.reshape(experts, rows, cols).transpose(1, 2).contiguous()
    return blocks.contiguous(), (exponent + 127).to(torch.uint8), dequantized


def dequantized_path(directory: str | Path) -> Path:
    """Where the writers put the unquantized twin of a quantized checkpoint: the same model holding the values the
    codes mean, saved by ``save_pretrained`` (the oracle for loaders)."""
    directory = Path(directory)
    return directory.parent / f"{directory.name}-dequantized"


def _write_twin(directory: Path, model, true: dict[str, torch.Tensor]) -> None:
    model.load_state_dict({**model.state_dict(), **true})
    model.save_pretrained(dequantized_path(directory))


def _write(directory: Path, model, tensors: dict[str, torch.Tensor], quantization: dict, shards: int = 3) -> None:
    """Save ``model``'s config with ``quantization`` and ``tensors`` over ``shards`` safetensors files + index."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[shard::shards]}
        save_file(part, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _quantized(name: str) -> bool:
    """The tensors the releases quantize: the projections of the decoder layers (not embeddings, norms, router,
    head)."""
    return ".layers." in name and name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj"))


def write_fp8_checkpoint(
    architecture: str,
    directory: Path,
    *,
    block: tuple[int, int] | None = (128, 128),
    legacy_experts: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    **overrides,
) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint of the tiny ``architecture`` (with config ``overrides``); returns the true (dequantized)
    value of every quantized model parameter by its model name. ``legacy_experts``: fused expert parameters are
    stored per expert (``experts.<e>.gate_proj.weight``, ...), as Qwen3-MoE-FP8 and DeepSeek-V3 ship them."""
    model = build_model(tiny_config(architecture, **overrides))
    tensors: dict[str, torch.Tensor] = {}
    true: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if not _quantized(name):
            tensors[name] = param
            continue
        if legacy_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            true[name] = _write_per_expert(tensors, name, param, block, scale_dtype)
            continue
        codes, scale = quantize_fp8(param, block)
        scale = scale.to(scale_dtype)
        true[name] = dequantize_fp8(codes, scale, block)
        tensors[name] = codes
        tensors[name + "_scale_inv"] = scale  # x.weight_scale_inv, experts.gate_up_proj_scale_inv
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    quantization["weight_block_size"] = list(block) if block is not None else None
    _write(Path(directory), model, tensors, quantization)
    _write_twin(Path(directory), model, true)
    return true


def _write_per_expert(
    tensors: dict[str, torch.Tensor],
    name: str,
    fused: torch.Tensor,
    block: tuple[int, int] | None,
    scale_dtype: torch.dtype,
) -> torch.Tensor:
    """Store the fused expert parameter ``name`` ([E, out, in]) per expert and projection, each quantized on its own
    (``experts.<e>.gate_proj.weight`` + ``weight_scale_inv``, ...); returns the fused dequantized value."""
    stem, _, fused_name = name.rpartition(".")
    projections = ("gate_proj", "up_proj") if fused_name == "gate_up_proj" else ("down_proj",)
    per_expert = []
    for expert in range(fused.shape[0]):
        parts = []
        for proj, part in zip(projections, fused[expert].chunk(len(projections), dim=0), strict=True):
            codes, scale = quantize_fp8(part, block)
            tensors[f"{stem}.{expert}.{proj}.weight"] = codes
            tensors[f"{stem}.{expert}.{proj}.weight_scale_inv"] = scale.to(scale_dtype)
            parts.append(dequantize_fp8(codes, scale.to(scale_dtype), block))
        per_expert.append(torch.cat(parts, dim=0))
    return torch.stack(per_expert)


def write_mxfp4_checkpoint(directory: Path, **overrides) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss whose expert projections are stored as MXFP4 (everything else bf16/fp32 as saved); returns the
    true value of every quantized parameter."""
    model = build_model(tiny_config("gpt_oss", **overrides))
    tensors: dict[str, torch.Tensor] = {}
    true: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, true[name] = quantize_mxfp4(param)
            tensors[name + "_blocks"] = blocks
            tensors[name + "_scales"] = scales
        else:
            tensors[name] = param
    _write(Path(directory), model, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": None})
    _write_twin(Path(directory), model, true)
    return true
