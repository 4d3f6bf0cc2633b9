"""Packed SFT sequences keep every example to itself: the same per-example losses and gradients as the examples run
unpacked, under FSDP2 and under context parallelism; a model that would let examples see each other is refused."""

from __future__ import annotations

import pytest

from tests.cases.packing import packed_vs_unpacked
from tests.tiny_models import save_tiny_checkpoint

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
LAYOUTS = {
    "fsdp2": {"strategy": "fsdp2"},
    "cp2": {"strategy": "fsdp2", "cp_size": 2},
    "tp2": {"strategy": "fsdp2", "tp_size": 2},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("packing")))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_packed_batch_equals_its_examples_unpacked(ranks2, checkpoint, layout):
    for result in ranks2.run(packed_vs_unpacked, checkpoint, layout):
        assert result["n_losses"] == 3 and result["check"] <= 1e-5, result
        assert result["losses"] <= TOLERANCE and result["grad"] <= TOLERANCE, result


def test_a_model_whose_attention_ignores_the_packed_mask_is_refused(ranks2, checkpoint):
    from tests.cases.packing import packing_error_for_causal_only_attention

    for error in ranks2.run(packing_error_for_causal_only_attention, checkpoint):
        assert "lets a packed example attend to the examples before it" in error and "causal_only" in error, error
        assert "data.packing=false" in error, error


ARCHITECTURES = ("qwen3", "mistral", "gemma3", "phi3", "gpt_neox", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_packing_keeps_examples_apart_across_architectures(ranks2, tmp_path, architecture):
    """Sliding-window attention (Gemma 3), no GQA (GPT-NeoX), fused projections (Phi-3) and routed experts: a packed
    batch still equals its examples unpacked under FSDP2."""
    checkpoint = str(save_tiny_checkpoint(architecture, tmp_path / architecture))
    for result in ranks2.run(packed_vs_unpacked, checkpoint, {"strategy": "fsdp2"}):
        assert result["n_losses"] == 3 and result["check"] <= 1e-5, result
        assert result["losses"] <= TOLERANCE and result["grad"] <= TOLERANCE, result
