"""Quantized checkpoints dequantized while they are read: each rank reads only the codes of its own shard and the
scales of the blocks that cover it, and turns them into the model's float dtype.

Supported, from ``config.json``'s ``quantization_config``:

- ``quant_method: fp8`` (DeepSeek-V3, Qwen3 ``-FP8``, Kimi-K2): a ``float8_e4m3fn`` / ``float8_e5m2`` tensor ``K``
  with ``K_scale_inv`` beside it (``x.weight`` -> ``x.weight_scale_inv``, fused experts' ``experts.gate_up_proj`` ->
  ``experts.gate_up_proj_scale_inv``; ``x.scale`` and ``x.qscale_weight`` are older names of ``x.weight_scale_inv``).
  The value is ``codes * scale`` of the element's block: ``weight_block_size`` over the last two dims (edge blocks
  partial), one scale per tensor when it is ``null``. Scales are float, or E8M0 exponents (``2 ** (byte - 127)``).
  Activation scales (static activation quantization) have no use in an unquantized model and are dropped.
- ``quant_method: mxfp4`` (gpt-oss): ``P_blocks`` [..., out, in / 32, 16] holds two E2M1 codes a byte and
  ``P_scales`` [..., out, in / 32] one E8M0 exponent per 32 codes; the parameter ``P`` is [..., in, out] (transformers'
  ``convert_moe_packed_tensors``, whose math is used on the slices).

Every other method is refused before anything is built. The model is built unquantized (the ``quantization_config``
is removed from its config, so an export is a plain checkpoint), and the values equal transformers' dequantization
(fp32 math, one cast to the parameter's dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel._compat.transformers import convert_moe_packed_tensors

from .checkpoint_files import CheckpointError, CheckpointFiles
from .sources import Source, StoredTensor, select

__all__ = [
    "SUPPORTED_METHODS",
    "DequantizedKeys",
    "QuantizationScheme",
    "UnsupportedQuantizationError",
    "dequantized_keys",
    "pop_quantization_scheme",
]

SUPPORTED_METHODS = ("fp8", "mxfp4")
_FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_E8M0 = frozenset({torch.uint8, *([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])})
_MXFP4_GROUP = 32  # codes per E8M0 scale
_FP8_ACTIVATION_SCALES = (".activation_scale", ".input_scale")


class UnsupportedQuantizationError(ValueError):
    """A checkpoint quantized with a method the loader cannot dequantize on read."""


@dataclass(frozen=True)
class QuantizationScheme:
    """How a checkpoint's weights are quantized (its ``quantization_config``, checked)."""

    method: str  # one of SUPPORTED_METHODS
    weight_block_size: tuple[int, int] | None = None  # fp8: the block of one scale; None: one scale per tensor
    config: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """E.g. ``fp8 (128x128 blocks)``, for the log and the load report."""
        if self.method == "fp8":
            blocks = self.weight_block_size
            return "fp8 (" + (f"{blocks[0]}x{blocks[1]} blocks" if blocks else "one scale per tensor") + ")"
        return "mxfp4 (E2M1 codes, one E8M0 scale per 32)"


def pop_quantization_scheme(config: Any) -> QuantizationScheme | None:
    """The checked quantization of a checkpoint whose config is ``config`` (``None``: not quantized), removed from
    ``config`` so that the model is built, and later exported, unquantized. Raises
    ``UnsupportedQuantizationError`` for a method that is not dequantized on read."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = str(raw.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise UnsupportedQuantizationError(
            f"The checkpoint is quantized with quant_method={method!r}, which cannot be loaded into a parallelized "
            f"model: the loader dequantizes {' and '.join(SUPPORTED_METHODS)} (block-scaled FP8, gpt-oss MXFP4) "
            "while reading. Dequantize it with transformers first (load it where that method runs, call "
            "model.dequantize() if the method offers it, or load it with its dequantize option, then "
            "save_pretrained) and load the unquantized copy."
        )
    block = raw.get("weight_block_size") if method == "fp8" else None
    if block is not None and (
        len(block) != 2 or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)
    ):
        raise UnsupportedQuantizationError(
            f"quantization_config.weight_block_size={block!r}: expected two positive block sizes, e.g. [128, 128]."
        )
    del config.quantization_config
    return QuantizationScheme(method, tuple(block) if block is not None else None, raw)


@dataclass
class DequantizedKeys:
    """The quantized tensors of a checkpoint as the float tensors they stand for."""

    sources: dict[str, Source] = field(default_factory=dict)  # the float tensor's key -> its dequantizing source
    consumed: set[str] = field(default_factory=set)  # stored keys that the sources read (codes, scales) or drop


def dequantized_keys(files: CheckpointFiles, scheme: QuantizationScheme | None) -> DequantizedKeys:
    """Describe every quantized tensor of ``files`` as a lazy source under the key of the float tensor it stands
    for. Without a ``scheme``, a checkpoint that holds quantized tensors is an error (never a silent cast)."""
    if scheme is None:
        _refuse_undeclared(files)
        return DequantizedKeys()
    if scheme.method == "fp8":
        return _fp8_keys(files, scheme)
    return _mxfp4_keys(files)


def _refuse_undeclared(files: CheckpointFiles) -> None:
    keys = set(files.keys())
    quantized = sorted(
        key
        for key in keys
        if files.dtype(key) in _FLOAT8
        or key.endswith("weight_scale_inv")
        or (key.endswith("_blocks") and key.removesuffix("_blocks") + "_scales" in keys)
    )
    if quantized:
        raise CheckpointError(
            f"The checkpoint holds quantized tensors ({_listing(quantized)}) but its config.json declares no "
            "quantization_config, so they cannot be dequantized (they would be cast without their scales). Restore "
            "the quantization_config of the release (quant_method fp8 or mxfp4), or use an unquantized checkpoint."
        )


def _fp8_keys(files: CheckpointFiles, scheme: QuantizationScheme) -> DequantizedKeys:
    keys = set(files.keys())
    found = DequantizedKeys()
    for key in sorted(keys):
        dtype = files.dtype(key)
        if dtype in (torch.int8, torch.uint8) and _fp8_scale_key(key, keys):
            raise UnsupportedQuantizationError(
                f"{key} is stored as {dtype} beside a block scale: packed FP4 weights in an fp8 checkpoint are not "
                "supported. Dequantize the checkpoint with transformers first."
            )
        if dtype not in _FLOAT8:
            continue
        scale_key = _fp8_scale_key(key, keys)
        if scale_key is None:
            raise CheckpointError(
                f"{key} is stored as {dtype} but has no scale beside it ({key}_scale_inv): the checkpoint is "
                "incomplete or not block-scaled FP8."
            )
        codes = StoredTensor(files, key, files.shape(key))
        scales = StoredTensor(files, scale_key, files.shape(scale_key))
        found.sources[key] = BlockScaledFloat8(codes, scales, _fp8_block(key, codes.shape, scales.shape, scheme))
        found.consumed |= {key, scale_key}
    stems = {key.removesuffix(".weight") for key in found.sources}
    found.consumed |= {key for key in keys if key.endswith(_FP8_ACTIVATION_SCALES) and key.rpartition(".")[0] in stems}
    return found


def _fp8_scale_key(key: str, keys: set[str]) -> str | None:
    candidates = [f"{key}_scale_inv"]
    if key.endswith(".weight"):
        stem = key.removesuffix(".weight")
        candidates += [f"{stem}.scale", f"{stem}.qscale_weight"]
    return next((candidate for candidate in candidates if candidate in keys), None)


def _fp8_block(
    key: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], scheme: QuantizationScheme
) -> tuple[int, ...]:
    """The block extent per dim of ``key`` (``shape``) whose scales have ``scale_shape``."""
    if math.prod(scale_shape) == 1:
        return shape  # one scale for the whole tensor
    if scheme.weight_block_size is None or len(shape) < 2 or len(scale_shape) != len(shape):
        raise CheckpointError(
            f"{key} {shape} has scales of shape {scale_shape}, which quantization_config.weight_block_size="
            f"{list(scheme.weight_block_size) if scheme.weight_block_size else None} does not describe."
        )
    block = (1,) * (len(shape) - 2) + scheme.weight_block_size
    expected = tuple(math.ceil(size / extent) for size, extent in zip(shape, block, strict=True))
    if expected != tuple(scale_shape):
        raise CheckpointError(
            f"{key} {shape} with weight_block_size {list(scheme.weight_block_size)} needs scales of shape "
            f"{expected}, the checkpoint has {tuple(scale_shape)}."
        )
    return block


def _mxfp4_keys(files: CheckpointFiles) -> DequantizedKeys:
    keys = set(files.keys())
    found = DequantizedKeys()
    for key in sorted(keys):
        if not key.endswith("_blocks"):
            continue
        name = key.removesuffix("_blocks")
        scale_key = f"{name}_scales"
        if scale_key not in keys:
            raise CheckpointError(f"{key} (MXFP4 codes) has no {scale_key} beside it: the checkpoint is incomplete.")
        blocks = StoredTensor(files, key, files.shape(key))
        scales = StoredTensor(files, scale_key, files.shape(scale_key))
        if len(blocks.shape) < 3 or blocks.shape[-1] * 2 != _MXFP4_GROUP or blocks.shape[:-1] != scales.shape:
            raise CheckpointError(
                f"{key} {blocks.shape} and {scale_key} {scales.shape} are not MXFP4 blocks ([..., out, in / 32, 16] "
                "codes and [..., out, in / 32] scales)."
            )
        found.sources[name] = Mxfp4(blocks, scales)
        found.consumed |= {key, scale_key}
    return found


@dataclass
class BlockScaledFloat8:
    """``codes * scale``: float8 ``codes`` and one ``scales`` entry per ``block`` (the scale of element ``i`` is
    ``scales[i // block]`` per dim). Reads the codes of the requested elements and the scales of their blocks only."""

    codes: Source
    scales: Source
    block: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        values = self.codes.read(indices).float()
        if math.prod(self.scales.shape) == 1:
            return values * _scale_values(self.scales.read([torch.arange(n) for n in self.scales.shape])).reshape(())
        block_ids = [
            torch.unique(dim_indices // extent, return_inverse=True)
            for dim_indices, extent in zip(indices, self.block, strict=True)
        ]
        scales = _scale_values(self.scales.read([unique for unique, _ in block_ids]))
        return values * select(scales, [inverse for _, inverse in block_ids])

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(self.read(indices))

    def stored_keys(self) -> list[str]:
        return self.codes.stored_keys() + self.scales.stored_keys()


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Float scales as float32; E8M0 exponents (uint8 or float8_e8m0fnu) as ``2 ** (byte - 127)``."""
    if scales.dtype in _E8M0:
        return torch.exp2(scales.view(torch.uint8).float() - 127.0)
    return scales.float()


@dataclass
class Mxfp4:
    """gpt-oss' MXFP4: ``blocks`` [..., out, groups, 16] (two E2M1 codes a byte) and ``scales`` [..., out, groups]
    stand for the parameter [..., groups * 32, out]. Reads the code groups holding the requested inputs."""

    blocks: Source
    scales: Source

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, groups, _ = self.blocks.shape
        return (*lead, groups * _MXFP4_GROUP, rows)

    def read(self, indices: list[torch.Tensor]) -> torch.Tensor:
        *lead, columns, rows = indices
        groups, inverse = torch.unique(columns // _MXFP4_GROUP, return_inverse=True)
        blocks = self.blocks.read([*lead, rows, groups, torch.arange(self.blocks.shape[-1])])
        scales = self.scales.read([*lead, rows, groups])
        flat = blocks.reshape(-1, *blocks.shape[-3:])  # transformers' function takes [n, out, groups, 16]
        values = convert_moe_packed_tensors(flat, scales.reshape(-1, *scales.shape[-2:]), dtype=torch.float32)
        values = values.reshape(*blocks.shape[:-3], len(groups) * _MXFP4_GROUP, len(rows))  # [..., inputs, out]
        return values.index_select(-2, inverse * _MXFP4_GROUP + columns % _MXFP4_GROUP)

    def read_into(self, indices: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(self.read(indices))

    def stored_keys(self) -> list[str]:
        return self.blocks.stored_keys() + self.scales.stored_keys()


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" ... and {len(names) - limit} more" if len(names) > limit else "")
