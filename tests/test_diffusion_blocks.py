"""Diffusers transformers that declare no ``_no_split_modules`` (DiT: no block declaration at all; LTX-Video: only
diffusers' ``_repeated_blocks``) load through ``NeMoAutoDiffusionPipeline`` with their repeated blocks as the FSDP
units and activation-checkpointing blocks: on 4 CPU ranks, with and without activation checkpointing, the
parallelized transformer's outputs and gradients match the plain diffusers component. DiT's output head also calls
a module of block 0 after the block loop, from outside its FSDP unit (``fsdp.unshard_for_outside_calls``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from automodel.distributed.model_structure import decoder_layers
from tests.cases.diffusion_blocks import (
    blocks_parity,
    save_tiny_dit_pipeline,
    save_tiny_ltx_pipeline,
    tiny_dit_transformer,
    tiny_ltx_transformer,
)

TOLERANCE = 1e-5  # fp32 on both sides; only the summation order of the data-parallel gradient average differs
LOGGER = "automodel.distributed.model_structure"
PIPELINES: dict[str, Callable[[Path], Path]] = {"dit": save_tiny_dit_pipeline, "ltx": save_tiny_ltx_pipeline}
PIPELINE_CLASSES = {"dit": "DiTPipeline", "ltx": "LTXPipeline"}
BLOCK_CLASSES = {"dit": "BasicTransformerBlock", "ltx": "LTXVideoTransformerBlock"}
# The composite children of each block that activation checkpointing wraps (not the parameter-free norms).
CHECKPOINTED_CHILDREN = {"dit": ["norm1", "attn1", "ff"], "ltx": ["attn1", "attn2", "ff"]}
BLOCKS = ["transformer_blocks.0", "transformer_blocks.1"]
LAYOUTS = {
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2+ac": {"strategy": "fsdp2", "activation_checkpointing": True},
    "fsdp2+selective-ac": {"strategy": "fsdp2", "activation_checkpointing": "selective"},
}


@pytest.fixture(scope="module")
def pipeline_dirs(tmp_path_factory) -> dict[str, str]:
    """Each tiny pipeline saved once for the module."""
    return {name: str(save(tmp_path_factory.mktemp(name))) for name, save in PIPELINES.items()}


@pytest.mark.parametrize("model", PIPELINES)
def test_saved_transformer_is_sharded(pipeline_dirs: dict[str, str], model: str) -> None:
    folder = Path(pipeline_dirs[model]) / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (folder / "diffusion_pytorch_model.safetensors").exists(), "only the shards may be read"


def test_decoder_layers_fall_back_to_the_transformer_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """DiT declares neither `_no_split_modules` nor `_repeated_blocks`: its blocks are found in the module tree."""
    model = tiny_dit_transformer()
    assert not getattr(model, "_no_split_modules", None) and not getattr(model, "_repeated_blocks", None)
    caplog.set_level(logging.INFO, logger=LOGGER)
    layers = decoder_layers(model)
    assert len(layers) == len(model.transformer_blocks) == 2
    assert all(layer is block for layer, block in zip(layers, model.transformer_blocks, strict=True))
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert messages == [
        "DiTTransformer2DModel declares no `_no_split_modules` blocks; using the repeated blocks of its module tree: "
        "transformer_blocks (2 x BasicTransformerBlock)"
    ]
    decoder_layers(model)
    assert len([record for record in caplog.records if record.name == LOGGER]) == 1, "logged once per model"


def test_decoder_layers_use_diffusers_repeated_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """LTX-Video declares no `_no_split_modules` but diffusers' `_repeated_blocks`: those are its blocks, no guess."""
    model = tiny_ltx_transformer()
    assert not getattr(model, "_no_split_modules", None) and model._repeated_blocks == ["LTXVideoTransformerBlock"]
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert decoder_layers(model) == list(model.transformer_blocks)
    assert not [record for record in caplog.records if record.name == LOGGER]


def _assert_blocks_parity(model: str, layout: dict[str, Any], result: dict[str, Any]) -> None:
    assert result["pipeline_class"] == PIPELINE_CLASSES[model] and result["same_class"], result
    assert not result["on_meta"], result["on_meta"]
    # The root and every block are units; any other unit lies inside a block.
    units = result["units"]
    assert units[0] == "" and set(BLOCKS) <= set(units), units
    assert all(any(unit.startswith(f"{block}.") for block in BLOCKS) for unit in set(units) - {"", *BLOCKS}), units
    expected_checkpointed = [f"{block}.{child}" for block in BLOCKS for child in CHECKPOINTED_CHILDREN[model]]
    assert result["checkpointed"] == (expected_checkpointed if layout.get("activation_checkpointing") else [])
    assert result["output_scale"] > 0.1 and result["grad_scale"] > 1e-3, "vanishing values would hide a wrong shard"
    assert result["output"] <= TOLERANCE, result
    assert result["n_grads"] == result["n_ref_grads"] == result["n_params"], result
    assert not result["no_grad"] and not result["ref_no_grad"], result
    assert result["grad"] <= TOLERANCE, result


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["ltx", "dit"])
def test_blocks_are_the_units_on_4_ranks(ranks4, pipeline_dirs: dict[str, str], model: str, layout: str) -> None:
    for result in ranks4.run(blocks_parity, pipeline_dirs[model], model, LAYOUTS[layout]):
        _assert_blocks_parity(model, LAYOUTS[layout], result)
        if model == "dit":  # the labels, an entry of model_index.json that is not a component, reach the pipeline
            assert result["labels"] == ["dog", "golden retriever", "tabby cat"], result["labels"]
