"""``save_pretrained`` and ``push_to_hub`` on a parallelized model, called on every rank as transformers' distributed
docs do: the consolidated checkpoint of ``save_hf_checkpoint``, which plain transformers loads with the sharded
model's logits; other files in the folder kept; what cannot be honoured refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, RepoUrl
from transformers import AutoModelForCausalLM

from automodel.distributed import MeshContext, ModelParallelizer
from automodel.distributed.parallel_model import ParallelizedModel
from tests.cases.export import push_to_hub_offline, save_pretrained_error, save_pretrained_parity
from tests.harness import RankPool
from tests.tiny_models import build_model, save_tiny_checkpoint, tiny_config, token_batch

TOLERANCE = 1e-5
LAYOUTS = {
    "fsdp2_on_2": (2, "llama", {"strategy": "fsdp2"}),
    "tp2": (2, "llama", {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_x_tp2": (4, "llama_tied", {"strategy": "fsdp2", "tp_size": 2}),
    "ep2": (4, "mixtral", {"strategy": "fsdp2", "ep_size": 2}),
    "ddp": (2, "llama", {"strategy": "ddp"}),
    "hsdp": (4, "llama", {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "cp2": (2, "llama", {"strategy": "fsdp2", "cp_size": 2}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        arch: str(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch)))
        for arch in ("llama", "llama_tied", "mixtral")
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "architecture", "layout"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_save_pretrained_on_every_rank_loads_in_plain_transformers(
    request, checkpoints, tmp_path, world, architecture, layout
):
    (tmp_path / "tokenizer.json").write_text("{}")  # a file already there that save_pretrained must keep
    (tmp_path / "model.safetensors").write_text("stale")  # weights from before, which it must replace
    pool: RankPool = request.getfixturevalue(f"ranks{world}")
    facts = pool.run(save_pretrained_parity, checkpoints[architecture], layout, str(tmp_path))[0]
    assert facts["logits"] <= TOLERANCE, facts
    assert facts["stored_keys"] == facts["plain_keys"], facts  # the names transformers' save_pretrained writes
    assert "tokenizer.json" in facts["files"] and "model.safetensors" not in facts["files"], facts["files"]
    assert "model.safetensors.index.json" in facts["files"] and "config.json" in facts["files"], facts["files"]
    assert facts["same_class"], facts  # still an instance of the transformers class that saved it


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"distributed_checkpoint": True}, "distributed_checkpoint=True) is not supported"),
        ({"state_dict": {}}, "state_dict=...) is not supported"),
        ({"safe_serialization": False}, "safe_serialization=False) is not supported"),
        ({"bogus": 1}, "unexpected keyword arguments ['bogus']"),
    ],
    ids=["dcp", "state_dict", "bin", "unknown"],
)
def test_what_save_pretrained_cannot_honour_is_refused_on_every_rank(ranks2, checkpoints, kwargs, expected):
    for message in ranks2.run(save_pretrained_error, checkpoints["llama"], **kwargs):
        assert expected in message, message


@pytest.fixture
def one_rank():
    """A process group of one rank in this process (torch's composable FSDP2 needs one), removed afterwards."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_push_to_hub_uploads_the_consolidated_checkpoint(one_rank, tmp_path, monkeypatch):
    """Only the hub calls are replaced: the folder they receive is the written checkpoint."""
    uploads = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        uploads.append({"files": sorted(p.name for p in folder.iterdir()), **kwargs})
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        uploads[-1]["logits"] = loaded(token_batch()).logits.detach()
        return CommitInfo(
            commit_url="https://huggingface.co/org/tiny/commit/abc",
            commit_message="m",
            commit_description="",
            oid="abc",
        )

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    model = ModelParallelizer().parallelize(build_model(tiny_config("llama")), MeshContext.build("fsdp2")).eval()
    assert isinstance(model, ParallelizedModel) and type(model).__name__ == "LlamaForCausalLM"
    url = model.push_to_hub("org/tiny", commit_message="first")
    assert url == "https://huggingface.co/org/tiny/commit/abc"
    (upload,) = uploads
    assert upload["repo_id"] == "org/tiny" and upload["commit_message"] == "first"
    assert "model.safetensors" in upload["files"] and "config.json" in upload["files"]
    assert torch.allclose(upload["logits"], model(token_batch()).logits, atol=TOLERANCE)
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="org/tiny")
    assert len(uploads) == 2 and (tmp_path / "saved" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_a_failed_upload_names_the_checkpoint_folder_on_every_rank_and_keeps_it(ranks2, checkpoints):
    """The hub unreachable (its repo creation replaced by an offline machine's error): every rank raises, naming the
    folder rank 0 wrote the checkpoint to (not a folder of its own that does not exist), which stays for `hf upload`."""
    import shutil

    results = ranks2.run(push_to_hub_offline, checkpoints["llama"])
    folder = results[0]["folder"]
    try:
        assert results[0]["kept"], results[0]
        for result in results:
            assert result["message"].startswith(f"ConnectionError: Uploading {folder} to org/tiny"), result
            assert f"upload it later with `hf upload org/tiny {folder}`" in result["message"], result
            assert "Name or service not known" in result["message"], result
    finally:
        shutil.rmtree(Path(folder).parent, ignore_errors=True)


def test_a_variant_replaces_only_its_own_weight_files(one_rank, tmp_path):
    """As transformers: saving the ``fp16`` variant next to the default weights keeps them, and both load."""
    model = ModelParallelizer().parallelize(build_model(tiny_config("llama")), MeshContext.build("fsdp2")).eval()
    (tmp_path / "tokenizer.json").write_text("{}")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    model.save_pretrained(tmp_path, variant="fp16")
    files = sorted(path.name for path in tmp_path.iterdir())
    assert "model.fp16.safetensors" in files and "model.safetensors.index.json" in files, files
    assert "tokenizer.json" in files
    for variant in (None, "fp16"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, variant=variant)
        assert torch.allclose(loaded(token_batch()).logits, model(token_batch()).logits, atol=TOLERANCE)
    model.save_pretrained(tmp_path)  # the plain weights again, unsharded: the old shards and index go
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.fp16.safetensors",
        "model.safetensors",
        "tokenizer.json",
    ], files
