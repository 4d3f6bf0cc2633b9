"""LoRA adapters (peft) through from_pretrained on the FSDP2 path: the same logits, loss and adapter gradients as
peft's get_peft_model on plain transformers, frozen base weights, and a merge that keeps the outputs."""

from __future__ import annotations

import pytest

from tests.cases.lora import lora_layout_error, lora_parity
from tests.tiny_models import save_tiny_checkpoint

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama_lora")))


@pytest.mark.parametrize(
    "layout",
    [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "dp_replicate_size": 2}],
    ids=["fsdp2_dp4", "hsdp_2x2"],
)
def test_lora_matches_peft_on_plain_transformers(ranks4, checkpoint, layout):
    for result in ranks4.run(lora_parity, checkpoint, layout):
        assert result["initial"] == 0.0, "zero lora_B: the adapted model starts as the base model"
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result
        assert result["trainable"] and all(".lora_" in name for name in result["trainable"])
        assert len(result["trainable"]) == 2 * 3 * 2  # A and B, three targets, two layers
        assert result["frozen_grads"] == []
        assert result["merged"] <= 1e-5 and result["names_after_merge"], result


def test_lora_refuses_tensor_parallelism(ranks2, checkpoint):
    message = ranks2.run(lora_layout_error, checkpoint, {"strategy": "fsdp2", "tp_size": 2})[0]
    assert "LoRA with tp_size=2" in message and "cannot be combined yet" in message
