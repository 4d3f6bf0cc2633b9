"""Context parallelism on CPU ranks: the same logits, loss and gradients as one plain process (CP=1), within 1e-4."""

from __future__ import annotations

import pytest

from tests.cases.context_parallel import cp_error, cp_parity

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("world", "layout"),
    [(2, {"strategy": "fsdp2", "cp_size": 2}), (4, {"strategy": "fsdp2", "cp_size": 2})],
    ids=["cp2", "cp2_x_dp_shard2"],
)
def test_context_parallel_matches_one_process(request, world, layout, architecture):
    pool = request.getfixturevalue(f"ranks{world}")
    for result in pool.run(cp_parity, layout, architecture, 16):
        assert result["local_len"] == 8
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


@pytest.mark.parametrize(
    "layout",
    [
        {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2},
        {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2, "sequence_parallel": True},
        {"strategy": "fsdp2", "cp_size": 2, "dp_replicate_size": 2, "activation_checkpointing": "selective"},
    ],
    ids=["cp2_x_tp2", "cp2_x_tp2_sp", "hsdp2_x_cp2_selective_ac"],
)
def test_context_parallel_composes_with_tp_sp_hsdp_and_ac(ranks4, layout):
    for result in ranks4.run(cp_parity, layout, "qwen3", 16):
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result


def test_sequence_not_a_multiple_of_two_cp_is_a_clear_error(ranks2):
    message = ranks2.run(cp_error, {"strategy": "fsdp2", "cp_size": 2}, "llama", 10)[0]
    assert "2 * cp_size = 4 chunks" in message and "length 10" in message


def test_sliding_window_blocks_are_refused_by_name(ranks2):
    message = ranks2.run(cp_error, {"strategy": "fsdp2", "cp_size": 2}, "mistral", None, sliding_window=4)[0]
    assert "decoder layer 0 (MistralDecoderLayer)" in message and "sliding window" in message
