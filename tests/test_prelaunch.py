"""What the ``automodel`` command refuses before it starts any process (``automodel.training.prelaunch``): each
mistake exits with status 2 and one message naming the key and its value, and torchrun is never started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from automodel.training import cli
from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint
from tests.conftest import REPO


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("prelaunch") / "model")


@pytest.fixture
def launch(tmp_path, recorded_torchrun, capsys):
    """``automodel sft`` in this process with a config of ``model`` and ``data`` and ``overrides``, torchrun replaced
    by a recorder. Returns (status, stderr, whether torchrun was started)."""

    def run(model_path, data=CHAT_DATA, *overrides: str, nproc: str | None = "2"):
        config = tmp_path / "sft.yaml"
        config.write_text(f"recipe: sft\nmodel: {{path: {model_path}}}\ndata: {{path: {data}}}\n")
        recorded_torchrun.clear()
        argv = ["sft", "--config", str(config), *(["--nproc-per-node", nproc] if nproc else []), *overrides]
        status = cli.main(argv)
        return status, capsys.readouterr().err, bool(recorded_torchrun)

    return run


def test_a_valid_config_launches_and_warns_when_nothing_would_be_saved(launch, model, tmp_path):
    status, err, started = launch(model)
    assert (status, started) == (0, True)
    assert "neither checkpoint.dir nor export.dir is set" in err
    status, err, started = launch(model, CHAT_DATA, f"export.dir={tmp_path / 'new' / 'export'}", nproc=None)
    assert (status, started) == (0, True) and "neither" not in err
    assert "starting 1 process on this node (no --nproc-per-node given)" in err
    assert not (tmp_path / "new").exists(), "the write probe leaves nothing behind"


def test_a_missing_model_path(launch, tmp_path):
    status, err, started = launch(tmp_path / "nope")
    assert (status, started) == (2, False)
    assert f"model.path={tmp_path / 'nope'}" in err and "neither a local directory nor a Hugging Face model id" in err


def test_a_folder_without_config_json(launch, tmp_path):
    (tmp_path / "empty").mkdir()
    status, err, started = launch(tmp_path / "empty")
    assert (status, started) == (2, False) and "config.json does not exist" in err


def test_a_hub_id_not_in_the_cache_while_offline(launch, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    status, err, started = launch("someone/not-cached")
    assert (status, started) == (2, False)
    assert "model.path=someone/not-cached" in err and "is not in the Hugging Face cache" in err


def test_a_data_path_that_does_not_exist_or_is_empty(launch, model, tmp_path):
    status, err, started = launch(model, tmp_path / "missing.jsonl")
    assert (status, started) == (2, False) and f"data.path={tmp_path / 'missing.jsonl'}: no such file" in err
    (tmp_path / "empty.jsonl").write_text("")
    status, err, started = launch(model, tmp_path / "empty.jsonl")
    assert (status, started) == (2, False) and "is an empty file" in err
    (tmp_path / "folder").mkdir()
    status, err, started = launch(model, tmp_path / "folder")
    assert (status, started) == (2, False) and "a folder without any file" in err
    (tmp_path / "folder" / "part-00000.staging").mkdir()  # a killed prepare-data
    (tmp_path / "folder" / "part-00000.staging" / "tokens.bin").write_bytes(b"\0" * 8)
    status, err, started = launch(model, tmp_path / "folder")
    assert (status, started) == (2, False) and "holds an unfinished `automodel prepare-data` output" in err
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "mixed" / "b.csv").write_text("text\nb\n")
    status, err, started = launch(model, tmp_path / "mixed")
    assert (status, started) == (2, False) and "holds .csv and .jsonl data files" in err


def test_output_folders_that_are_files_or_not_writable(launch, model, tmp_path):
    (tmp_path / "a-file").write_text("x")
    status, err, started = launch(model, CHAT_DATA, f"export.dir={tmp_path / 'a-file'}")
    assert (status, started) == (2, False) and f"export.dir={tmp_path / 'a-file'} exists and is not a folder" in err
    status, err, started = launch(model, CHAT_DATA, f"checkpoint.dir={tmp_path / 'a-file' / 'ckpt'}")
    assert (status, started) == (2, False) and "is a file, so the folder cannot be created" in err
    # /proc takes no new folders, even from root (the tests run as root, where permission bits do not stop a write)
    status, err, started = launch(model, CHAT_DATA, "checkpoint.dir=/proc/automodel-ckpt")
    assert (status, started) == (2, False) and "checkpoint.dir=/proc/automodel-ckpt is not writable" in err


def test_an_export_into_the_base_models_folder(launch, model):
    """The export replaces the weight files of its folder: in model.path, those the run starts and resumes from."""
    status, err, started = launch(model, CHAT_DATA, f"export.dir={model}")
    assert (status, started) == (2, False) and f"export.dir={model} is model.path" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["layout.tp_size=4"], "num_key_value_heads=2 is not divisible by tp_size=4"),
        (["layout.ep_size=2"], "LlamaForCausalLM has no routed experts"),
        (["layout.pp_size=4"], "The model has 2 decoder layers and the pipeline 4 stages"),
    ],
    ids=["heads-vs-tp", "experts-vs-ep", "layers-vs-pp"],
)
def test_a_layout_the_model_cannot_take_is_refused_with_the_real_runs_message(launch, model, overrides, message):
    """The tiny checkpoint has 4 heads, 2 KV heads, 2 layers and no experts: each layout is refused by the run's own
    check (rank 0 simulated before launch), naming the layout keys, the process count and the model."""
    status, err, started = launch(model, CHAT_DATA, *overrides, nproc="4")
    assert (status, started) == (2, False), err
    assert f"{overrides[0]} on 4 processes does not fit model.path={model}" in err and message in err, err
    assert "rank 1" not in err, "a failure every simulated rank shares is said once"
    status, err, started = launch(model, CHAT_DATA, "layout.tp_size=2", nproc="4")
    assert (status, started) == (0, True), err


def test_a_failing_layout_check_warns_and_launches(launch, model, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("simulated")

    monkeypatch.setattr("automodel.planning.layout_refusal", broken)
    status, err, started = launch(model)
    assert (status, started) == (0, True)
    assert "the layout could not be checked against the model before launch (KeyError" in err


def test_a_misspelled_key_gets_a_suggestion(launch, model):
    status, err, started = launch(model, CHAT_DATA, "train.max_step=3")
    assert (status, started) == (2, False) and "Did you mean train.max_steps?" in err


@pytest.mark.parametrize("mistake", ["missing-model", "tp-vs-heads"])
def test_the_command_refuses_within_seconds_before_any_process(model, tmp_path, mistake):
    """The real command in a fresh interpreter (imports included); the time is printed, not asserted (it is the
    machine's): about 5-8 s on a 2-core CI machine, most of it importing torch and transformers."""
    path = tmp_path / "nope" if mistake == "missing-model" else model
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: {path}}}\ndata: {{path: {CHAT_DATA}}}\n")
    overrides = ["layout.tp_size=4"] if mistake == "tp-vs-heads" else []
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(config), "--nproc-per-node", "4"]
        + overrides,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    seconds = time.perf_counter() - started
    assert result.returncode == 2, result.stderr
    assert f"model.path={path}" in result.stderr and "torch.distributed.run" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    print(f"{mistake}: refused in {seconds:.1f} s")


def test_sft_data_mistakes_the_ranks_would_hit_after_loading_are_refused_first(launch, model, tmp_path):
    """Text given to SFT, fewer records than one global batch, and a tokenizer without a chat template."""
    (tmp_path / "corpus.txt").write_text("some text")
    status, err, started = launch(model, tmp_path / "corpus.txt")
    assert (status, started) == (2, False) and "is a text file: SFT reads chat records" in err
    status, err, started = launch(model, CHAT_DATA, "train.global_batch_size=100000")
    assert (status, started) == (2, False) and "fewer than one global batch of train.global_batch_size=100000" in err
    plain = tmp_path / "no_template"
    shutil.copytree(model, plain)
    for name in ("chat_template.jinja", "chat_template.json"):
        (plain / name).unlink(missing_ok=True)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    status, err, started = launch(plain)
    assert (status, started) == (2, False) and "its tokenizer has no chat template" in err


def test_few_long_documents_are_enough_to_pretrain_on(model, tmp_path):
    """Pretraining cuts documents into sequences: two records can fill many global batches (no SFT record count)."""
    from automodel.training.config import load_config
    from automodel.training.prelaunch import _check_records

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a long document"}\n{"text": "another long document"}\n')
    config = tmp_path / "pretrain.yaml"
    config.write_text(f"recipe: pretrain\nmodel: {{path: {model}}}\ndata: {{path: {corpus}}}\n")
    _check_records(load_config(config, ["train.global_batch_size=8"]), Path(model))
