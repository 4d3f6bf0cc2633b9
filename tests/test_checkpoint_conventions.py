"""Checkpoints transformers loads by its own conventions load the same here, on every layout: a config that ties the
head to an embedding the checkpoint stores apart with other values (untied, with transformers' warning), tied copies
stored equal (tied), legacy buffers old checkpoints still carry (ignored where the model has such a buffer), a folder
holding both a single file and an index (the single file), and ``dtype="auto"`` for a config that records no dtype
(the checkpoint's)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from tests.cases import loading_errors as cases
from tests.tiny_models import VOCAB, build_model, tiny_config, token_batch

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
LAYOUTS = {
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2_tp2": {"strategy": "fsdp2", "tp_size": 2},
    "pp2": {"strategy": "fsdp2", "pp_size": 2, "pp_microbatches": 2},
}


def _edit_config(directory: Path, drop: tuple[str, ...] = (), **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=token_batch(batch_size=2)).logits


@pytest.fixture(scope="module")
def separate_head(tmp_path_factory) -> Path:
    """An untied Llama whose config was then edited to tie its head to the embedding: the files hold both, apart."""
    directory = tmp_path_factory.mktemp("separate_head")
    build_model(tiny_config("llama"), seed=1).save_pretrained(directory)
    _edit_config(directory, tie_word_embeddings=True)
    return directory


def test_a_head_the_checkpoint_stores_apart_is_not_tied_to_the_embedding(separate_head, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="automodel.loading.tied_copies"):
        result = cases.untied_copies(str(separate_head), None, str(tmp_path / "export"))
    assert not result["tied_here"] and {HEAD, EMBEDDING} <= set(result["held"]), result
    assert max(result["loaded"].values()) == 0.0, result
    assert result["reloaded"] == 0.0 and not result["reloaded_tied"], result
    assert "ties lm_head.weight to model.embed_tokens.weight, but the checkpoint holds both with different" in (
        caplog.text
    ), caplog.text
    # What transformers does with the same checkpoint (the oracle the case compares with): it unties too.
    reference = AutoModelForCausalLM.from_pretrained(separate_head)
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_head_the_checkpoint_stores_apart_is_not_tied_on_any_layout(ranks2, separate_head, tmp_path, layout):
    results = ranks2.run(cases.untied_copies, str(separate_head), LAYOUTS[layout], str(tmp_path / "export"))
    held = set().union(*(result["held"] for result in results))
    assert {HEAD, EMBEDDING} <= held, held
    for result in results:
        assert not result["tied_here"] and max(result["loaded"].values()) <= 1e-6, result
    assert results[0]["reloaded"] <= 1e-6 and not results[0]["reloaded_tied"], results[0]


def test_tied_copies_the_checkpoint_stores_equal_stay_tied(tmp_path):
    build_model(tiny_config("llama_tied"), seed=2).save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda tensors: tensors.update({HEAD: tensors[EMBEDDING].clone()}))
    result = cases.untied_copies(str(tmp_path), None, str(tmp_path / "export"))
    assert result["tied_here"] and result["held"].count(EMBEDDING) == 1 and HEAD not in result["held"], result
    assert max(result["loaded"].values()) == 0.0 and result["reloaded"] == 0.0 and result["reloaded_tied"], result


def _bert_decoder(directory: Path) -> Path:
    """A tiny BERT causal LM (``BertLMHeadModel``), saved with the ``position_ids`` buffer older checkpoints hold."""
    config = AutoConfig.for_model(
        "bert",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        is_decoder=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    _edit_weights(directory, lambda tensors: tensors.update({"bert.embeddings.position_ids": torch.arange(64)[None]}))
    return directory


def test_legacy_buffers_are_ignored_where_the_model_has_them(tmp_path):
    bert = _bert_decoder(tmp_path / "bert")
    assert torch.equal(
        _logits(NeMoAutoModelForCausalLM.from_pretrained(bert)), _logits(AutoModelForCausalLM.from_pretrained(bert))
    )
    llama = tmp_path / "llama"
    build_model(tiny_config("llama"), seed=3).save_pretrained(llama)
    _edit_weights(
        llama, lambda tensors: tensors.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    )
    assert torch.equal(
        _logits(NeMoAutoModelForCausalLM.from_pretrained(llama)), _logits(AutoModelForCausalLM.from_pretrained(llama))
    )


def test_a_legacy_buffer_the_model_does_not_have_is_still_unexpected(tmp_path):
    """Llama has no ``position_ids`` buffer: transformers reports the key as unexpected, and strict loading refuses."""
    build_model(tiny_config("llama"), seed=3).save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda tensors: tensors.update({"model.position_ids": torch.arange(8)[None]}))
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the model: model\.position_ids"):
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path)


def test_the_single_file_wins_over_an_index_as_in_transformers(tmp_path):
    """A repo re-uploaded sharded without deleting its old ``model.safetensors``: transformers reads the single file."""
    single = build_model(tiny_config("llama"), seed=4)
    build_model(tiny_config("llama"), seed=5).save_pretrained(tmp_path, max_shard_size="40KB")
    single.save_pretrained(tmp_path / "single")
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    logits = _logits(NeMoAutoModelForCausalLM.from_pretrained(tmp_path))
    assert torch.equal(logits, _logits(AutoModelForCausalLM.from_pretrained(tmp_path)))
    assert torch.equal(logits, _logits(single.eval()))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_dtype_auto_takes_the_checkpoints_dtype_when_the_config_records_none(tmp_path, stored, caplog):
    build_model(tiny_config("llama"), seed=6).to(stored).save_pretrained(tmp_path)
    _edit_config(tmp_path, drop=("dtype", "torch_dtype"))
    logging.Logger.warning_once.cache_clear()  # transformers says a deprecation once per process
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path)
    assert "torch_dtype` is deprecated" not in caplog.text, "the user passed no torch_dtype"
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == reference.dtype == stored
    assert torch.equal(_logits(model), _logits(reference))


def test_a_base_model_leaves_out_the_head_of_a_task_checkpoint(tmp_path):
    """``NeMoAutoModel`` on a ``...ForCausalLM`` checkpoint, as ``AutoModel`` does: the base model's tensors under
    ``model.`` load, the head outside it is left out; an unknown tensor under the prefix is still refused."""
    from transformers import AutoModel

    from automodel.auto_model import NeMoAutoModel
    from automodel.loading.checkpoint_files import CheckpointError

    build_model(tiny_config("llama", tie_word_embeddings=False), seed=3).save_pretrained(tmp_path)
    expected = AutoModel.from_pretrained(tmp_path)
    model = NeMoAutoModel.from_pretrained(str(tmp_path))
    batch = token_batch(batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(model(batch).last_hidden_state, expected(batch).last_hidden_state, rtol=0, atol=0)
    _edit_weights(tmp_path, lambda tensors: tensors.update({"model.stray.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model: model\.stray\.weight"):
        NeMoAutoModel.from_pretrained(str(tmp_path))
