"""The trainability policy holds on every path: parameters frozen by ``MeshContext.reapply_trainability`` (or frozen
before ``parallelize``) stay frozen through TP (whose sequence-parallel norms are rebuilt as new parameters), EP,
activation checkpointing and the shard step, get no gradient, and the others match plain transformers."""

from __future__ import annotations

import pytest

from tests.cases.trainability import frozen_parity

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp2": (4, {"strategy": "fsdp2"}, "llama"),
    "fsdp2_full_ac": (4, {"strategy": "fsdp2", "activation_checkpointing": "full"}, "llama"),
    "tp2_sp": (4, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}, "llama"),
    "ep2_selective_ac": (4, {"strategy": "fsdp2", "ep_size": 2, "activation_checkpointing": "selective"}, "mixtral"),
    "ddp": (2, {"strategy": "ddp"}, "llama"),
    "ddp_full_ac": (2, {"strategy": "ddp", "activation_checkpointing": "full"}, "llama"),
}


@pytest.mark.parametrize("via", ["callback", "frozen_before"])
@pytest.mark.parametrize(("world", "layout", "architecture"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_frozen_embeddings_and_norms_stay_frozen(request, world, layout, architecture, via):
    for result in request.getfixturevalue(f"ranks{world}").run(frozen_parity, layout, architecture, via):
        assert result["expected"] and result["frozen"] == result["expected"], result
        # Frozen parameters get no gradient here, as in the reference; every other gradient matches.
        assert result["no_grad"] == result["ref_no_grad"] == result["expected"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= 1e-5, result
