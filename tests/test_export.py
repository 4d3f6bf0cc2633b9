"""``save_hf_checkpoint``: a trained, parallelized model exported as a checkpoint plain transformers loads.

The distributed cases load a tiny checkpoint for a layout, train one SGD step, export, and load the export with plain
``transformers`` on rank 0: logits equal the sharded model's within 1e-5, the stored tensor names are those
``save_pretrained`` writes (per-expert MoE tensors included), tied weights are stored once. The single-process tests
cover the files next to the weights, the model card, ``push_to_hub`` and the failure guarantees.
"""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from automodel.loading import parallel_export
from automodel.loading.export import ModelCardInfo, push_to_hub, save_hf_checkpoint, write_model_card
from tests.cases.export import export_parity, export_refused
from tests.tiny_models import build_model, save_tiny_checkpoint, tiny_config, token_batch

TOLERANCE = 1e-5
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

CASES = {
    "llama-fsdp2_dp4": ("llama", {"strategy": "fsdp2"}),
    "llama-fsdp2_tp_2x2": ("llama", {"strategy": "fsdp2", "tp_size": 2}),
    "llama_tied-fsdp2_tp_2x2": ("llama_tied", {"strategy": "fsdp2", "tp_size": 2}),
    "mixtral-ep2": ("mixtral", {"strategy": "fsdp2", "ep_size": 2}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        arch: str(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch)))
        for arch in ("llama", "llama_tied", "mixtral")
    }


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_export_of_sharded_model_loads_in_plain_transformers(ranks4, checkpoints, tmp_path, case):
    arch, layout = CASES[case]
    target = tmp_path / "export"
    results = ranks4.run(export_parity, checkpoints[arch], layout, str(target), "40KB")
    facts = results[0]
    assert results[1:] == [None, None, None]
    assert facts["logits"] <= TOLERANCE, facts["logits"]
    assert facts["moved_by_training"] > 1e-3, "the export must hold the trained weights, not the checkpoint's"
    assert facts["on_meta"] == []
    # The names save_pretrained writes (Mixtral: per-expert w1/w2/w3 under block_sparse_moe), each stored once.
    assert sorted(facts["stored_keys"]) == facts["save_pretrained_keys"]
    assert len(facts["stored_keys"]) == len(set(facts["stored_keys"]))
    # Several shards of the small max_shard_size, named as transformers names them, and an index that agrees.
    shards = [name for name in facts["files"] if name.endswith(".safetensors")]
    assert len(shards) > 1 and all(SHARD_NAME.fullmatch(name) for name in shards)
    assert {int(SHARD_NAME.fullmatch(name)[2]) for name in shards} == {len(shards)}
    by_file = {key: file for file, keys in facts["file_keys"].items() for key in keys}
    assert facts["weight_map"] == by_file
    assert facts["index_metadata"]["total_size"] > 0 and facts["index_metadata"]["total_parameters"] > 0
    assert {"config.json", "generation_config.json", "README.md", "model.safetensors.index.json"} <= set(facts["files"])
    assert facts["architectures"] == [{"mixtral": "MixtralForCausalLM"}.get(arch, "LlamaForCausalLM")]
    if arch == "llama_tied":
        assert "lm_head.weight" not in facts["stored_keys"] and facts["tied"]
    if arch == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in facts["stored_keys"]
    assert not [p.name for p in tmp_path.iterdir() if p.name != "export"], "no temporary directory is left behind"


@pytest.mark.distributed
def test_existing_target_is_refused_on_every_rank(ranks4, checkpoints, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    messages = ranks4.run(export_refused, checkpoints["llama"], str(tmp_path))
    assert all("already exists and is not empty" in message and "overwrite=True" in message for message in messages)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_unsharded_export_equals_save_pretrained(tmp_path):
    model = build_model(tiny_config("llama"))
    model.save_pretrained(tmp_path / "plain", max_shard_size="40KB")
    save_hf_checkpoint(model, tmp_path / "export", max_shard_size="40KB", tokenizer=_tokenizer())
    plain = json.loads((tmp_path / "plain" / "model.safetensors.index.json").read_text())
    ours = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert ours == plain
    for file in sorted({*plain["weight_map"].values()}):
        with safe_open(tmp_path / "plain" / file, "pt") as a, safe_open(tmp_path / "export" / file, "pt") as b:
            assert a.keys() == b.keys() and a.metadata() == b.metadata()
            assert all(torch.equal(a.get_tensor(key), b.get_tensor(key)) for key in a.keys())
    assert AutoTokenizer.from_pretrained(tmp_path / "export")("hello world")["input_ids"] == [1, 2]
    assert (tmp_path / "export" / "generation_config.json").is_file()
    assert not (tmp_path / "export" / "README.md").exists()


def test_one_file_without_index_when_it_fits(tmp_path):
    model = build_model(tiny_config("llama_tied"))
    save_hf_checkpoint(model, tmp_path / "export")
    assert sorted(p.name for p in (tmp_path / "export").glob("model*")) == ["model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    batch = token_batch()
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, model(batch).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_model_card_metadata_parses(tmp_path):
    info = ModelCardInfo(
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        training_summary={"recipe": "sft", "steps": 30, "lr": 1e-4, "layout": {"strategy": "fsdp2", "tp_size": 2}},
        tags=("sft", "automodel"),
        license="apache-2.0",
        datasets=("org/chat-data",),
    )
    path = write_model_card(tmp_path, info, model_id="org/my-model")
    card = ModelCard.load(path)
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["automodel", "sft"] and data["license"] == "apache-2.0"
    assert data["datasets"] == ["org/chat-data"]
    assert data["training_config"] == {
        "recipe": "sft",
        "steps": 30,
        "lr": 1e-4,
        "layout": {"strategy": "fsdp2", "tp_size": 2},
    }
    assert '| layout | {"strategy": "fsdp2", "tp_size": 2} |' in card.text
    assert (
        'NeMoAutoModelForCausalLM.from_pretrained("org/my-model", mesh_context=MeshContext.build("fsdp2"))' in card.text
    )
    assert 'AutoModelForCausalLM.from_pretrained("org/my-model")' in card.text


def test_model_card_keeps_a_local_base_model_out_of_the_metadata(tmp_path):
    info = ModelCardInfo(base_model=str(tmp_path), training_summary={"steps": 1})
    card = ModelCard.load(write_model_card(tmp_path, info, model_id=str(tmp_path / "out")))
    assert "base_model" not in card.data.to_dict()
    assert f"starting from `{tmp_path}`" in card.text


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(tmp_path, monkeypatch):
    save_hf_checkpoint(build_model(tiny_config("llama")), tmp_path / "export")
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", self.token, repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", self.token, kwargs))
        return CommitInfo(
            commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc",
            commit_message="m",
            commit_description="",
            oid="abc",
        )

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = push_to_hub(tmp_path / "export", "org/tiny", token="hf_x", private=True)
    assert url == "https://huggingface.co/org/tiny/commit/abc"
    assert calls == [
        ("create_repo", "hf_x", "org/tiny", {"exist_ok": True, "private": True}),
        (
            "upload_folder",
            "hf_x",
            {
                "repo_id": "org/tiny",
                "folder_path": tmp_path / "export",
                "commit_message": "Upload model trained with automodel",
                "repo_type": "model",
            },
        ),
    ]
    with pytest.raises(FileNotFoundError, match="save_hf_checkpoint"):
        push_to_hub(tmp_path, "org/tiny")


def test_existing_target_is_refused_and_overwrite_replaces_it(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old.txt").write_text("old")
    model = build_model(tiny_config("llama"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_checkpoint(model, target)
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    save_hf_checkpoint(model, target, overwrite=True)
    assert not (target / "old.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    (tmp_path / "empty").mkdir()
    save_hf_checkpoint(model, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize("overwrite", [False, True])
def test_failure_mid_write_leaves_no_partial_export(tmp_path, monkeypatch, overwrite):
    target = tmp_path / "export"
    if overwrite:
        target.mkdir()
        (target / "previous.txt").write_text("previous export")
    written = []
    real_write_box = parallel_export.write_box

    def fail_after_first_tensor(fd, *args):
        if written:
            raise OSError("No space left on device")
        written.append(fd)
        real_write_box(fd, *args)

    monkeypatch.setattr(parallel_export, "write_box", fail_after_first_tensor)
    with pytest.raises(OSError, match="No space left"):
        save_hf_checkpoint(build_model(tiny_config("llama")), target, max_shard_size="40KB", overwrite=overwrite)
    assert len(written) == 1
    if overwrite:
        assert [p.name for p in target.iterdir()] == ["previous.txt"], "the previous export stays as it was"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["export"] if overwrite else [])


def test_bad_arguments_are_clear_errors(tmp_path):
    model = build_model(tiny_config("llama"))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        save_hf_checkpoint(torch.nn.Linear(2, 2), tmp_path / "a")
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        save_hf_checkpoint(model, tmp_path / "b", max_shard_size="lots")
    with pytest.raises(TypeError, match="tokenizer"):
        save_hf_checkpoint(model, tmp_path / "c", tokenizer="gpt2")
    with pytest.raises(TypeError, match="ModelCardInfo"):
        save_hf_checkpoint(model, tmp_path / "d", model_card={"base_model": "x"})
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        save_hf_checkpoint(model, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_wrapper_with_module_is_unwrapped(tmp_path):
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = build_model(tiny_config("llama"))
    save_hf_checkpoint(Wrapper(model), tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())


def test_the_export_gets_the_mode_of_any_new_folder(tmp_path):
    """The staging folder comes from mkdtemp (private, 0700): the export it becomes is readable as the umask allows
    (a serving account, the rest of a team)."""
    mask = os.umask(0o022)
    try:
        save_hf_checkpoint(build_model(tiny_config("llama")), tmp_path / "export")
        save_hf_checkpoint(build_model(tiny_config("llama")), tmp_path / "export", overwrite=True)
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755


def test_the_recipes_export_keeps_the_other_files_of_its_folder(tmp_path):
    """``export.dir`` as ``save_pretrained`` saves into a folder: the export's files and an earlier export's weight
    files are replaced, everything else stays (a user's notes, a checkpoint.dir inside it)."""
    from automodel.training.config import load_config
    from automodel.training.export_step import export_trained
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint

    base = save_tiny_chat_checkpoint(tmp_path / "base")
    target = tmp_path / "export"
    (target / "ckpt" / "step_00000001").mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    (target / "model-00001-of-00002.safetensors").write_text("an earlier export's shard")
    (target / "model.safetensors.index.json").write_text("{}")
    config_file = tmp_path / "sft.yaml"
    config_file.write_text(
        f"recipe: sft\nmodel: {{path: {base}}}\ndata: {{path: {CHAT_DATA}}}\nexport: {{dir: {target}}}\n"
    )
    model = AutoModelForCausalLM.from_pretrained(base)
    assert export_trained(load_config(config_file), model, None) == target
    assert (target / "notes.txt").read_text() == "mine" and (target / "ckpt" / "step_00000001").is_dir()
    assert not (target / "model-00001-of-00002.safetensors").exists()
    assert not (target / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    expected = model.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in reloaded.state_dict().items())
