"""The ``automodel`` command line shows its commands: ``--help`` lists the five with a line each (and the exit
statuses), a bare ``automodel`` prints that list, an unknown command names the commands, and a key mistyped in the
YAML file gets the command line's "did you mean" with the file and the line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from automodel.training.commands import COMMANDS, EXIT_STATUSES
from automodel.training.config import ConfigError, load_config

FIVE = ("sft", "pretrain", "plan", "prepare-data", "init-config")


def _automodel(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "automodel.training.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_help_lists_the_five_commands_with_a_line_each_and_the_exit_statuses():
    result = _automodel("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert tuple(COMMANDS) == FIVE
    for name in FIVE:
        (line,) = [line for line in lines if line.startswith(f"  {name} ")]
        assert COMMANDS[name] in line, line
    for status, meaning in EXIT_STATUSES.items():
        assert f"{status:>5}  {meaning}" in result.stdout
    assert "export.push_to_hub (a valid repo name, a token, the hub reachable)" in result.stdout


def test_a_bare_automodel_prints_the_commands_and_exits_2():
    result = _automodel()
    assert result.returncode == 2 and result.stdout == ""
    assert all(f"  {name} " in result.stderr for name in FIVE), result.stderr
    assert "the following arguments are required" not in result.stderr


def test_an_unknown_command_names_the_commands():
    result = _automodel("train", "--config", "x.yaml")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "automodel: 'train' is not a command; did you mean `automodel pretrain`? The commands are sft, pretrain, "
        "plan, prepare-data, init-config (automodel --help)."
    )


def test_a_yaml_key_typo_gets_did_you_mean_with_the_file_and_the_line(tmp_path):
    """`learning_rate` (transformers' name) in the file: the command refuses it at its line, with the key meant; the
    same typo as an override has no file to name."""
    config = tmp_path / "sft.yaml"
    config.write_text(
        "recipe: sft\nmodel:\n  path: some/model\ndata:\n  path: data.jsonl\ntrain:\n  max_steps: 3\n"
        "  learning_rate: 1.0e-4\n"
    )
    result = _automodel("sft", "--config", str(config), "--nproc-per-node", "2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"automodel: config error: {config}:8: Unknown config key(s) train.learning_rate; Did you mean train.lr?"
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match=r"^Unknown config key\(s\) train.learning_rate; Did you mean train.lr\?"):
        load_config(None, ["train.learning_rate=1e-4"])


@pytest.mark.parametrize(
    ("yaml_text", "line", "message"),
    [
        ("train:\n  max_steps: ten\n", 2, "train.max_steps='ten' must be an integer"),
        ("layout:\n  tensor_parallel_size: 2\n", 2, "Did you mean layout.tp_size?"),
        ("lora:\n  r: 8\n", 2, "Did you mean lora.rank?"),
        ("trian:\n  lr: 1\n", 1, "Unknown config key(s) trian; Did you mean train?"),
        ("data:\n  blend:\n    - {path: a, wieght: 1}\n", 3, "Unknown config key(s) data.blend[0].wieght"),
    ],
)
def test_config_errors_of_keys_in_the_file_name_their_line(tmp_path, yaml_text, line, message):
    config = tmp_path / "recipe.yaml"
    data = "# data: below\n" if yaml_text.startswith("data:") else "data: {path: d}\n"  # one data section
    config.write_text(f"recipe: pretrain\nmodel: {{path: m}}\n{data}{yaml_text}")
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert str(error.value).startswith(f"{config}:{line + 3}: "), error.value
    assert message in str(error.value), error.value


def test_the_default_log_dir_is_relative_to_the_config_file_like_its_other_paths(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    config = tmp_path / "project" / "sft.yaml"
    config.write_text("recipe: sft\nmodel: {path: m}\ndata: {path: d.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(config).log.dir == str(tmp_path / "project" / "automodel_logs")
    assert load_config(config, ["log.dir=here"]).log.dir == "here"  # the command line's paths: the current folder
    assert "the default log.dir, are relative to its folder" in _automodel("sft", "--help").stdout
