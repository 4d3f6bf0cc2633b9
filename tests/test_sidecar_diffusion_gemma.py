"""DiffusionGemma sidecar: loads through ``NeMoAutoModel`` as the sidecar class, one FSDP unit per pair of tied
encoder / decoder layers with their experts as a unit before it, a TP plan that places tied twins alike; outputs and
gradients match plain transformers (no labels: logits and the gradients of ``mean(logits ** 2)``)."""

from __future__ import annotations

import pytest

from tests.cases.sidecar_diffusion_gemma import (
    default_tp_plan_error,
    default_vs_sidecar,
    loaded_parity,
    save_diffusion_gemma_checkpoint,
)

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
TEXT_LAYERS = ("model.encoder.language_model.layers.", "model.decoder.layers.")
SIDECAR_TEXT_UNITS = [
    "model.encoder.language_model.layers.0.experts,model.decoder.layers.0.experts",
    "model.encoder.language_model.layers.1.experts,model.decoder.layers.1.experts",
    "model.encoder.language_model.layers.0,model.decoder.layers.0",
    "model.encoder.language_model.layers.1,model.decoder.layers.1",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("diffusion_gemma")))


def _assert_parity(result: dict) -> None:
    assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
    # Only the vision tower (no image in the batch) gets no gradient, here as in plain transformers.
    assert result["no_grad"] == result["ref_no_grad"], result
    assert all(".vision_tower." in n or ".embed_vision." in n for n in result["no_grad"]), result["no_grad"]
    assert max(result["logits"], result["grad"]) <= TOLERANCE, result


LAYOUTS = {
    "fsdp2_dp4": {"strategy": "fsdp2"},
    "fsdp2_tp_2x2": {"strategy": "fsdp2", "tp_size": 2},
    # The unified MoE path: EP places the encoder's experts and their decoder twins alike, and each twin pair of
    # experts is one unit over ep_shard; the sidecar's twin-layer units and primitive hold there too.
    "ep2": {"strategy": "fsdp2", "ep_size": 2},
    "ep2_x_tp2": {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_loaded_parity(ranks4, checkpoint, layout):
    for result in ranks4.run(loaded_parity, checkpoint, layout):
        assert result["sidecar"], "NeMoAutoModel must build the registered sidecar class, with its PARALLELIZER"
        _assert_parity(result)
        assert result["tied_head"] and result["tied_layers"], "tied parameters must stay one parameter"
        text_units = [unit for unit in result["units"] if unit.startswith(TEXT_LAYERS)]
        assert text_units == SIDECAR_TEXT_UNITS, result["units"]
        expected = {"_apply_fsdp_sharding@dp_shard_cp", "_fully_shard_module@dp_shard_cp"}
        if layout.get("ep_size", 1) > 1:
            expected.add("_fully_shard_module@ep_shard")  # the twin experts, through the sidecar's primitive
        assert result["hooks"] == sorted(expected), result["hooks"]


def test_sidecar_units_differ_from_the_default_and_parity_holds_with_both(ranks4, checkpoint):
    default = ranks4.run(default_vs_sidecar, checkpoint, False)
    sidecar = ranks4.run(default_vs_sidecar, checkpoint, True)
    for result in (*default, *sidecar):
        _assert_parity(result)
    # Every text layer holds a parameter tied to its twin, so the shared traversal leaves them all in the root.
    assert not [unit for unit in default[0]["units"] if unit.startswith(TEXT_LAYERS)], default[0]["units"]
    assert [unit for unit in sidecar[0]["units"] if unit.startswith(TEXT_LAYERS)] == SIDECAR_TEXT_UNITS
    assert set(default[0]["units"]) < set(sidecar[0]["units"]), (default[0]["units"], sidecar[0]["units"])


def test_default_tp_plan_places_tied_twins_apart(ranks4, checkpoint):
    errors = ranks4.run(default_tp_plan_error, checkpoint)
    assert errors[0] is not None and all(error == errors[0] for error in errors), errors
    assert "model.decoder.embed_tokens.weight" in errors[0] and "sharded differently" in errors[0], errors[0]
