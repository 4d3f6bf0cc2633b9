"""``export.push_to_hub`` is checked before launch (a valid repo name, the hub not switched off, a token, the hub
answering with it) and refused with exit 2 before any process starts; an upload that fails at the end is said after
where the export is on disk, with exit status 3. No network: the hub's address is a closed local port, and where the
hub must answer, ``HfApi.whoami`` is replaced; nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants

from automodel.training.commands import EXIT_UPLOAD_FAILED
from automodel.training.config import ConfigError
from automodel.training.hub_upload import check_push_to_hub
from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint
from tests.conftest import REPO

CLOSED_PORT = "http://127.0.0.1:9"  # nothing listens: a connection is refused at once, as offline


@pytest.fixture
def no_stored_token(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize(
    ("repo", "setting", "message"),
    [
        ("org/a/b", {}, "export.push_to_hub=org/a/b is not a valid repo name"),
        ("org/name", {"offline": True}, "the hub is switched off here (HF_HUB_OFFLINE=1)"),
        ("org/name", {}, "export.push_to_hub=org/name needs a Hugging Face token that can write: run `hf auth login`"),
        ("org/name", {"token": "hf_x", "endpoint": CLOSED_PORT}, "did not accept the token or cannot be reached"),
    ],
    ids=["name", "offline", "token", "unreachable"],
)
def test_what_would_make_the_upload_fail_is_refused(no_stored_token, monkeypatch, repo, setting, message):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", setting.get("offline", False))
    if "token" in setting:
        monkeypatch.setenv("HF_TOKEN", setting["token"])
    monkeypatch.setattr(constants, "ENDPOINT", setting.get("endpoint", constants.ENDPOINT))
    with pytest.raises(ConfigError) as error:
        check_push_to_hub(repo, "/runs/export")
    assert message in str(error.value), error.value
    if repo == "org/name":  # the way around: upload later
        assert "or drop export.push_to_hub and upload export.dir afterwards: hf upload" in str(error.value)


def test_a_read_only_token_and_a_hub_that_does_not_answer_are_refused(no_stored_token, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setattr(
        HfApi, "whoami", lambda self, token=None: {"name": "ada", "auth": {"accessToken": {"role": "read"}}}
    )
    with pytest.raises(ConfigError, match="the token of ada can only read"):
        check_push_to_hub("org/name", None)
    never = threading.Event()
    monkeypatch.setattr(HfApi, "whoami", lambda self, token=None: never.wait())
    with pytest.raises(ConfigError, match=r"did not answer within 0 s"):
        check_push_to_hub("org/name", None, timeout_s=0.2)
    never.set()
    monkeypatch.setattr(
        HfApi, "whoami", lambda self, token=None: {"name": "ada", "auth": {"accessToken": {"role": "write"}}}
    )
    check_push_to_hub("org/name", None)


def _command(tmp_path: Path, *overrides: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    model = save_tiny_chat_checkpoint(tmp_path / "model")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {CHAT_DATA}}}\n"
        "train: {max_steps: 2, global_batch_size: 4, micro_batch_size: 2, seq_len: 32}\n"
        "export: {dir: export, push_to_hub: org/tiny-chat}\n"
    )
    base = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(config), "--nproc-per-node", "2"]
        + list(overrides),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**base, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": CLOSED_PORT, "HF_HUB_OFFLINE": "0", **env},
    )


@pytest.mark.distributed
def test_the_command_refuses_an_upload_that_cannot_happen_before_any_process_starts(tmp_path):
    result = _command(tmp_path, env={"HF_TOKEN": "hf_x"})
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("automodel: config error: export.push_to_hub=org/tiny-chat: the hub (http://127.0.0.1:9)")
    assert "cannot be reached from here (ConnectError" in line, line
    assert not (tmp_path / "automodel_logs").exists() and not (tmp_path / "export").exists(), "nothing started"


# Workers and command alike: the hub answers whoami (the pre-launch check passes); its other calls are left alone and
# fail as offline.
ANSWERING_HUB = """
from huggingface_hub import HfApi
HfApi.whoami = lambda self, token=None, **kwargs: {"name": "ada", "auth": {"accessToken": {"role": "write"}}}
"""


@pytest.mark.distributed
def test_an_upload_that_fails_at_the_end_says_where_the_export_is_and_exits_3(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(ANSWERING_HUB)
    pythonpath = os.pathsep.join([str(hooks), str(REPO)])
    result = _command(tmp_path, env={"HF_TOKEN": "hf_x", "PYTHONPATH": pythonpath})
    assert result.returncode == EXIT_UPLOAD_FAILED == 3, result.stderr[-3000:]
    export = tmp_path / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    lines = result.stderr.strip().splitlines()
    on_disk = f"automodel sft: the export is on disk in {export}; uploading it to org/tiny-chat"
    assert lines[-2] == on_disk, lines[-5:]
    assert lines[-1].startswith(f"automodel sft: upload failed: the export is on disk in {export}, but uploading"), (
        lines
    )
    assert "ConnectError" in lines[-1] and lines[-1].endswith(f"hf upload org/tiny-chat {export}"), lines[-1]
    assert "automodel sft: 2 steps, final loss" in result.stdout and "Traceback" not in result.stderr
