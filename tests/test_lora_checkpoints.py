"""LoRA training checkpoints hold what training changes: the adapter, its optimizer state, the data position and the
RNG. The frozen base is read again from ``model.path`` on resume, whose identity the checkpoint records: a changed
base is refused on every rank, a moved one (the same files elsewhere) is accepted and said. Resumes are bitwise under
FSDP2 (through the real command), TP and PP; each LoRA checkpoint is at most 5% of the full fine-tuning checkpoint of
the same model and layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from automodel.training.base_identity import BaseChanged, base_identity, check_base_identity
from tests.cases.training import CHAT_DATA, resume_error, save_tiny_chat_checkpoint, train, train_and_report
from tests.conftest import REPO

# The tiny chat model at a width where an adapter is small beside the model (as it is on real models: hidden 256,
# 1.3 M parameters; rank-8 adapters on q_proj and v_proj are 1.2% of them).
WIDE = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = ["lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj, v_proj]", "train.lr=3e-2"]
LIMIT = 0.05  # of the full fine-tuning checkpoint


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("wide") / "model", **WIDE)


def _config(tmp_path: Path, model: Path) -> str:
    path = tmp_path / "sft.yaml"
    path.write_text(
        f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {CHAT_DATA}}}\n"
        "train: {max_steps: 6, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, warmup_steps: 1}\n"
    )
    return str(path)


def _size(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())


def _saved_keys(checkpoint: Path) -> set[str]:
    return set(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)


def _losses(checkpoint: Path) -> list[float]:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=True)["losses"]


def _only_the_adapter(keys: set[str]) -> bool:
    """Model tensors are LoRA factors, and the optimizer's state and groups are theirs only."""
    parameters = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
    optimizer = {key for key in keys if key.startswith("optimizer.")}
    return bool(parameters) and all(".lora_" in name for name in parameters) and all(".lora_" in k for k in optimizer)


@pytest.mark.distributed
def test_the_command_saves_the_adapter_alone_and_resumes_it_bitwise(wide_checkpoint, tmp_path):
    """2 CPU ranks, FSDP2: the full fine-tuning checkpoint of the model, then LoRA run through, and stopped after 3
    steps and run again. The LoRA checkpoint is at most 5% of the full one and holds no base weight; the resumed
    run's losses are the uninterrupted run's, bitwise."""
    config = _config(tmp_path, wide_checkpoint)

    def automodel(*overrides: str) -> None:
        command = [sys.executable, "-m", "automodel.training.cli", "sft", "--config", config, "--nproc-per-node", "2"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    automodel(f"checkpoint.dir={tmp_path / 'full'}", "train.max_steps=1")
    automodel(*LORA, f"checkpoint.dir={tmp_path / 'through'}")
    automodel(*LORA, f"checkpoint.dir={tmp_path / 'lora'}", "train.stop_after_steps=3")
    stopped = tmp_path / "lora" / "step_00000003"
    full, lora = _size(tmp_path / "full" / "step_00000001"), _size(stopped)
    print(f"checkpoint sizes: full fine-tuning {full} bytes, LoRA {lora} bytes ({lora / full:.1%})")
    assert lora <= LIMIT * full, (lora, full)
    assert _only_the_adapter(_saved_keys(stopped)), sorted(_saved_keys(stopped))[:8]
    automodel(*LORA, f"checkpoint.dir={tmp_path / 'lora'}")
    assert _losses(tmp_path / "lora" / "step_00000006") == _losses(tmp_path / "through" / "step_00000006")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["layout.tp_size=2", "layout.pp_size=2"], ids=["tp2", "pp2"])
def test_under_tp_and_pp_the_adapter_alone_is_saved_and_resumes_bitwise(ranks2, wide_checkpoint, tmp_path, layout):
    config = _config(tmp_path, wide_checkpoint)
    ranks2.run(train, config, [layout, f"checkpoint.dir={tmp_path / 'full'}", "train.max_steps=1"])
    through = ranks2.run(train, config, [*LORA, layout])[0]["losses"]
    checkpoints = [*LORA, layout, f"checkpoint.dir={tmp_path / 'lora'}"]
    ranks2.run(train, config, [*checkpoints, "train.stop_after_steps=3"])
    stopped = tmp_path / "lora" / "step_00000003"
    assert _size(stopped) <= LIMIT * _size(tmp_path / "full" / "step_00000001")
    assert _only_the_adapter(_saved_keys(stopped)), sorted(_saved_keys(stopped))[:8]
    resumed = ranks2.run(train, config, checkpoints)[0]
    assert resumed["resumed_from"] == 3 and resumed["losses"] == through


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["layout.strategy=fsdp2", "layout.pp_size=2"], ids=["fsdp2", "pp2"])
def test_a_tied_frozen_head_is_not_saved_under_its_own_name(ranks2, tmp_path, layout):
    """torch's ignore_frozen_params drops a frozen parameter under its first name only: a tied head kept the frozen
    embedding under its own (a LoRA checkpoint of SmolLM2-135M was 117 MiB, not 9). Under PP the last stage's head
    also answers to the embedding's name. Only the adapter is saved, and the resume is bitwise."""
    base = save_tiny_chat_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    config = _config(tmp_path, base)
    through = ranks2.run(train, config, [*LORA, layout])[0]["losses"]
    checkpoints = [*LORA, layout, f"checkpoint.dir={tmp_path / 'ckpt'}"]
    ranks2.run(train, config, [*checkpoints, "train.stop_after_steps=3"])
    keys = _saved_keys(tmp_path / "ckpt" / "step_00000003")
    assert _only_the_adapter(keys) and not any("lm_head" in key or "embed_tokens" in key for key in keys), keys
    assert ranks2.run(train, config, checkpoints)[0]["losses"] == through


@pytest.mark.distributed
def test_a_changed_base_is_refused_and_a_moved_one_is_said(ranks2, tmp_path):
    """The LoRA checkpoint of step 3, then: the base written again in place (same shapes, new weights: refused, on
    every rank), a base of another shape at another path (refused), the base copied elsewhere (accepted, said, and
    the resume is bitwise), and the checkpoint resumed without LoRA (refused)."""
    base = save_tiny_chat_checkpoint(tmp_path / "base")
    shutil.copytree(base, tmp_path / "copy")  # the same files, before anything changes
    config = _config(tmp_path, base)
    through = ranks2.run(train, config, LORA)[0]["losses"]
    checkpoints = [*LORA, f"checkpoint.dir={tmp_path / 'ckpt'}"]
    ranks2.run(train, config, [*checkpoints, "train.stop_after_steps=3"])
    resumed = ranks2.run(train_and_report, config, [*checkpoints, f"model.path={tmp_path / 'copy'}"])[0]
    assert resumed["losses"] == through, "the same base at another path resumes bitwise"
    assert any(line.startswith("the base model moved:") and str(base) in line for line in resumed["log"])

    ranks2.run(train, config, [*checkpoints, "train.max_steps=8", "train.stop_after_steps=1"])  # step 7, from base
    save_tiny_chat_checkpoint(base, seed=1)  # written again: the same files by name and size, other weights
    for message in ranks2.run(resume_error, config, [*checkpoints, "train.max_steps=8"]):
        assert message.startswith("BaseChanged: Resuming from"), message
        assert f"model.path={base}: config.json, model.safetensors changed (written again) since" in message, message
        assert "the base weights are read from model.path" in message, message
    wider = save_tiny_chat_checkpoint(tmp_path / "wider", **WIDE)
    (message, _) = ranks2.run(resume_error, config, [*checkpoints, "train.max_steps=8", f"model.path={wider}"])
    assert f"model.path={wider} (the checkpoint's base was {base}) is not the base" in message, message
    assert "model.safetensors has " in message and "config.json has " in message, message
    (message, _) = ranks2.run(resume_error, config, [f"checkpoint.dir={tmp_path / 'ckpt'}", "train.max_steps=8"])
    assert "holds only the trainable parameters of a run with a frozen base (LoRA)" in message, message


def test_the_identity_compares_files_and_says_what_differs(tmp_path):
    base = save_tiny_chat_checkpoint(tmp_path / "base")
    saved = base_identity(str(base), base)
    assert set(saved["files"]) == {"config.json", "model.safetensors"}, "tokenizer files are not the base's weights"
    assert check_base_identity(saved, base_identity(str(base), base), tmp_path / "ckpt") is None
    (base / "tokenizer_config.json").write_text("{}")  # another chat template: still the same base
    assert check_base_identity(saved, base_identity(str(base), base), tmp_path / "ckpt") is None
    with pytest.raises(BaseChanged, match=r"revision 'v2', but .* was trained on revision None"):
        check_base_identity(saved, base_identity(str(base), base, "v2"), tmp_path / "ckpt")
    (base / "model.safetensors").unlink()
    with pytest.raises(BaseChanged, match="model.safetensors is gone"):
        check_base_identity(saved, base_identity(str(base), base), tmp_path / "ckpt")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["layout.strategy=fsdp2", "layout.pp_size=2"], ids=["fsdp2", "pp2"])
def test_a_resume_that_trains_other_tensors_is_refused_before_anything_is_read(ranks2, tmp_path, layout):
    """A checkpoint holds the trainable tensors only: a resume whose run trains others (fewer LoRA targets, another
    rank, LoRA on a full fine-tuning checkpoint) is refused on every rank, naming the tensors, instead of dropping the
    trained adapters it does not have (fewer targets) or failing inside torch.distributed.checkpoint. Under PP each
    rank holds one stage's tensors: the checkpoint's tensors that no stage holds are what counts."""
    base = save_tiny_chat_checkpoint(tmp_path / "base")
    config = _config(tmp_path, base)
    lora = [*LORA, layout, f"checkpoint.dir={tmp_path / 'lora'}"]
    ranks2.run(train, config, [*lora, "train.stop_after_steps=3"])
    fewer = [*lora, "lora.target_modules=[q_proj]"]
    for message in ranks2.run(resume_error, config, fewer):
        assert message.startswith("CheckpointMismatch: Resuming from"), message
        assert "model.layers.0.self_attn.v_proj.lora_A.default.weight" in message, message
        assert "which this run does not train" in message and "lora.target_modules" in message, message
    for message in ranks2.run(resume_error, config, [*lora, "lora.rank=4"]):
        assert "shapes differ: model.layers.0.self_attn.q_proj.lora_A.default.weight (saved (8, 32), now (4, 32))" in (
            message
        ), message
    full = [layout, f"checkpoint.dir={tmp_path / 'full'}"]
    ranks2.run(train, config, [*full, "train.stop_after_steps=3"])
    for message in ranks2.run(resume_error, config, [*full, *LORA]):
        assert "it lacks model.layers.0.self_attn.q_proj.lora_A.default.weight" in message, message
    resumed = ranks2.run(train_and_report, config, [*lora, "data.seed=1"])[0]
    assert resumed["resumed_from"] == 3, "the same settings resume"
    assert any(line.startswith("data.seed=1 is not the checkpoint's (0)") for line in resumed["log"]), resumed["log"]
