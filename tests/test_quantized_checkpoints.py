"""Quantized checkpoints (block-scaled FP8, gpt-oss MXFP4) dequantized on read into parallelized models.

Each checkpoint is written by the tests in its release's on-disk layout (``tests/quantized_checkpoints.py``) beside an
unquantized twin holding the values the codes mean. The reference is plain single-process transformers: loading the
quantized checkpoint itself with its CPU dequantization where that is right, else the twin. transformers 5.24's CPU
FP8 dequantization derives the block size from the scale grid, which is wrong when a dimension is not a multiple of
the block (rows 160 with 128-row blocks: it uses 80-row blocks), and it ignores the scales of fused expert tensors
(``experts.gate_up_proj_scale_inv``), casting the raw codes; those two cases are checked against the twin.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel import NeMoAutoModelForCausalLM
from tests.cases.quantized import (
    bf16_weights,
    export_and_reload,
    layout_error,
    quantized_bytes,
    quantized_parity,
    reference_model,
)
from tests.quantized_checkpoints import write_fp8_checkpoint, write_mxfp4_checkpoint

TOLERANCE = 1e-5

# name: (writer, reference)
CHECKPOINTS = {
    # 128x128 blocks over dims that are not multiples of 128 (160, 200; heads of 40): shards cut through blocks.
    "llama_fp8_uneven": (
        lambda d: write_fp8_checkpoint("llama", d, hidden_size=160, intermediate_size=200, head_dim=40),
        "dequantized",
    ),
    # 128x128 blocks over multiples of 128: FSDP2 and TP shards of 32 / 64 rows cut through blocks.
    "llama_fp8": (
        lambda d: write_fp8_checkpoint("llama", d, hidden_size=128, intermediate_size=256, head_dim=32),
        "transformers",
    ),
    "llama_fp8_per_tensor": (lambda d: write_fp8_checkpoint("llama", d, block=None), "transformers"),
    # E8M0 scales (powers of two, as MXFP8-style releases store them), 16x16 blocks.
    "llama_fp8_e8m0_scales": (
        lambda d: write_fp8_checkpoint("llama", d, block=(16, 16), scale_dtype=torch.float8_e8m0fnu),
        "transformers",
    ),
    # Qwen3-MoE-FP8's own layout: per-expert keys, each projection with its own grid (16x16 blocks: several a matrix).
    "qwen3_moe_fp8_legacy": (
        lambda d: write_fp8_checkpoint("qwen3_moe", d, block=(16, 16), legacy_experts=True),
        "transformers",
    ),
    # Fused expert tensors with one grid per expert (experts.gate_up_proj + experts.gate_up_proj_scale_inv).
    "qwen3_moe_fp8_fused": (lambda d: write_fp8_checkpoint("qwen3_moe", d, block=(16, 16)), "dequantized"),
    "gpt_oss_mxfp4": (lambda d: write_mxfp4_checkpoint(d), "transformers"),
}

DENSE = {
    "fsdp2": {"strategy": "fsdp2"},
    "tp2": {"strategy": "fsdp2", "tp_size": 2},  # dp_shard=2: FSDP2 x TP
}
MOE = {
    "fsdp2": {"strategy": "fsdp2"},
    "tp2": {"strategy": "fsdp2", "tp_size": 2},
    "ep2": {"strategy": "fsdp2", "ep_size": 2},
    "ep2_x_tp2": {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
}
TP_ONLY = {"strategy": "fsdp2", "tp_size": 2}  # on 2 ranks: TP=2 alone


def _matrix():
    for name in CHECKPOINTS:
        layouts = MOE if "moe" in name or "gpt_oss" in name else DENSE
        for layout_name, layout in layouts.items():
            yield pytest.param(name, layout, id=f"{name}-{layout_name}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every quantized checkpoint: its path and the true value of each quantized parameter."""
    written = {}
    for name, (write, _) in CHECKPOINTS.items():
        directory = tmp_path_factory.mktemp("quantized") / name
        written[name] = (str(directory), write(directory))
    return written


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_one_process_load_gives_the_values_the_codes_mean(checkpoints, name, caplog):
    path, true = checkpoints[name]
    with caplog.at_level(logging.INFO, logger="automodel"):
        model = NeMoAutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    assert max((state[key] - value).abs().max().item() for key, value in true.items()) == 0.0
    assert not hasattr(model.config, "quantization_config"), "the model is unquantized: no stale config"
    method = "mxfp4" if "mxfp4" in name else "fp8"
    assert f"is quantized ({method} (" in caplog.text and f"tensors from {method} (" in caplog.text, caplog.text
    reference = dict(reference_model(path, CHECKPOINTS[name][1]).named_parameters())
    assert max((p - reference[n]).abs().max().item() for n, p in model.named_parameters()) == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "layout"), _matrix())
def test_quantized_checkpoint_loads_parallelized_with_plain_transformers_numerics(ranks4, checkpoints, name, layout):
    path, _ = checkpoints[name]
    for rank, result in enumerate(ranks4.run(quantized_parity, path, CHECKPOINTS[name][1], layout)):
        assert result["weights"] <= TOLERANCE, f"rank {rank}: {result}"
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
        assert not result["quantization_config"] and result["sharded"] > 0, result


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama_fp8_uneven", "qwen3_moe_fp8_legacy", "gpt_oss_mxfp4"])
def test_tp_alone_on_two_ranks(ranks2, checkpoints, name):
    path, _ = checkpoints[name]
    for result in ranks2.run(quantized_parity, path, CHECKPOINTS[name][1], TP_ONLY):
        assert max(result["weights"], result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


@pytest.mark.distributed
def test_bf16_weights_equal_transformers_bf16_dequantization(ranks4, checkpoints):
    for difference in ranks4.run(bf16_weights, checkpoints["llama_fp8"][0], {"strategy": "fsdp2", "tp_size": 2}):
        assert difference == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("llama_fp8_uneven", {"strategy": "fsdp2"}),
        ("llama_fp8_uneven", {"strategy": "fsdp2", "tp_size": 2}),
        ("qwen3_moe_fp8_legacy", {"strategy": "fsdp2", "ep_size": 2}),
        ("qwen3_moe_fp8_fused", {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}),
        ("gpt_oss_mxfp4", {"strategy": "fsdp2", "ep_size": 4}),
        ("gpt_oss_mxfp4", {"strategy": "fsdp2"}),
    ],
    ids=[
        "llama-fsdp2",
        "llama-tp2",
        "qwen3_moe_legacy-ep2",
        "qwen3_moe_fused-ep2_x_tp2",
        "gpt_oss-ep4",
        "gpt_oss-fsdp2",
    ],
)
def test_each_rank_reads_only_the_codes_and_scales_of_its_shards(ranks4, checkpoints, name, layout):
    for result in ranks4.run(quantized_bytes, checkpoints[name][0], layout):
        assert result["read"] <= 1.1 * result["least"], result


UNSUPPORTED = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "gptq": {"quant_method": "gptq", "bits": 4},
    "awq": {"quant_method": "awq", "bits": 4},
    "compressed-tensors": {"quant_method": "compressed-tensors"},
    "torchao": {"quant_method": "torchao"},
}


def _with_config(source: str, destination, edit) -> str:
    """A copy of the checkpoint folder ``source`` whose config.json ``edit`` changes (weights linked, not copied)."""
    from pathlib import Path

    destination.mkdir()
    for path in Path(source).iterdir():
        (destination / path.name).symlink_to(path)
    (destination / "config.json").unlink()
    config = json.loads((Path(source) / "config.json").read_text())
    edit(config)
    (destination / "config.json").write_text(json.dumps(config))
    return str(destination)


@pytest.mark.distributed
@pytest.mark.parametrize("method", UNSUPPORTED)
def test_other_quantization_methods_are_refused_on_every_rank(ranks2, checkpoints, tmp_path, method):
    path = _with_config(
        checkpoints["llama_fp8"][0], tmp_path / method, lambda c: c.update(quantization_config=UNSUPPORTED[method])
    )
    for error in ranks2.run(layout_error, path, {"strategy": "fsdp2"}):
        assert f"quant_method='{method}'" in error and "fp8 and mxfp4" in error and "Dequantize it" in error, error


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama_fp8", "gpt_oss_mxfp4"])
def test_undeclared_quantized_tensors_are_refused_on_every_rank(ranks2, checkpoints, tmp_path, name):
    """float8 codes (FP8) or uint8 blocks (MXFP4) with no quantization_config: an error, never a silent cast."""
    path = _with_config(checkpoints[name][0], tmp_path / name, lambda c: c.pop("quantization_config"))
    for error in ranks2.run(layout_error, path, {"strategy": "fsdp2"}):
        assert "holds quantized tensors" in error and "declares no quantization_config" in error, error


def test_older_scale_names_load_alike(checkpoints, tmp_path):
    """``x.scale`` (DeepSeek-V4-Flash) and ``x.qscale_weight`` (Mistral Large) name ``x.weight_scale_inv``."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path, true = checkpoints["llama_fp8"]
    for suffix in (".scale", ".qscale_weight"):
        renamed = tmp_path / suffix.strip(".")
        renamed.mkdir()
        for source in Path(path).iterdir():
            if source.suffix != ".safetensors":
                (renamed / source.name).write_bytes(source.read_bytes())
                continue
            tensors = {key.replace(".weight_scale_inv", suffix): value for key, value in load_file(source).items()}
            save_file(tensors, renamed / source.name, metadata={"format": "pt"})
        index = json.loads((renamed / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k.replace(".weight_scale_inv", suffix): v for k, v in index["weight_map"].items()}
        (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
        state = NeMoAutoModelForCausalLM.from_pretrained(renamed, dtype=torch.float32).state_dict()
        assert max((state[key] - value).abs().max().item() for key, value in true.items()) == 0.0


def test_integer_tensors_for_float_parameters_are_refused(tmp_path):
    """Packed bytes under a float parameter's own name (no scales, no config): refused, not cast."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import save_tiny_checkpoint

    directory = save_tiny_checkpoint("llama", tmp_path / "packed", max_shard_size="10MB")
    weights = load_file(directory / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = torch.zeros(weights[name].shape, dtype=torch.uint8)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="integer tensors for float parameters.*up_proj"):
        NeMoAutoModelForCausalLM.from_pretrained(directory, strict=False)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama_fp8_uneven", "gpt_oss_mxfp4"])
def test_export_of_a_quantized_load_is_a_plain_checkpoint(ranks4, checkpoints, tmp_path, name):
    directory = tmp_path / "export"
    results = ranks4.run(export_and_reload, checkpoints[name][0], {"strategy": "fsdp2", "tp_size": 2}, str(directory))
    for result in results:
        assert result["logits"] <= TOLERANCE and result["dtypes"] == ["torch.float32"], result
        assert not result["quantization_config"], result
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    exported = AutoModelForCausalLM.from_pretrained(directory)
    assert not hasattr(exported.config, "quantization_config")


def test_scales_that_do_not_match_the_block_size_are_refused(checkpoints, tmp_path):
    path = _with_config(
        checkpoints["llama_fp8"][0],
        tmp_path / "wrong_block",
        lambda c: c["quantization_config"].update(weight_block_size=[32, 32]),
    )
    with pytest.raises(
        ValueError, match=r"weight_block_size \[32, 32\] needs scales of shape \(4, 8\), the checkpoint has \(1, 2\)"
    ):
        NeMoAutoModelForCausalLM.from_pretrained(path)
