"""The installable package: ``automodel init-config``, and the wheel working in a fresh virtualenv outside the repo.

The wheel test builds the sdist and the wheel with ``python -m build`` from a copy of the sources, installs the wheel
into a new virtualenv (torch and transformers pinned to the releases running this test, so pip takes them from its
cache or the local wheel folder), and from a folder outside the checkout runs ``automodel --help``, writes an example
config with ``automodel init-config sft``, trains it with ``automodel sft`` on 2 ranks, and checks ``from_pretrained``
logits against plain transformers on 2 ranks under torchrun.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from automodel.training.config import load_config
from automodel.training.init_config import write_example_config

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("automodel", "model_sidecars", "pyproject.toml", "README.md")


@pytest.mark.parametrize("recipe", ["sft", "pretrain"])
def test_init_config_writes_a_config_that_loads(tmp_path: Path, recipe: str) -> None:
    config_path = write_example_config(recipe, tmp_path / "here")
    config = load_config(config_path, recipe=recipe)
    assert config.recipe == recipe and not config.model.tiny_if_missing, "a mistyped path must not train a new model"
    assert Path(config.data.path).is_file() and Path(config.data.path).is_relative_to(tmp_path / "here")
    assert Path(config.model.path) == tmp_path / "here" / "tiny-llama"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(config.model.path).iterdir()}


def test_a_mistyped_model_path_in_an_init_config_config_is_refused_before_launch(tmp_path: Path) -> None:
    """The example's model is written by init-config, and its config asks for nothing more: `./tiny-lama` (a typo) is
    refused by the command with exit 2 naming the path, where tiny_if_missing used to train a new random model."""
    command = [sys.executable, "-m", "automodel.training.cli"]
    written = subprocess.run(
        [*command, "init-config", "sft", "--output", str(tmp_path)], capture_output=True, text=True
    )
    assert written.returncode == 0 and "its tiny model" in written.stdout, written.stderr
    config = tmp_path / "sft.yaml"
    config.write_text(config.read_text().replace("path: ./tiny-llama", "path: ./tiny-lama"))
    result = subprocess.run(
        [*command, "sft", "--config", str(config), "--nproc-per-node", "2"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert f"model.path={tmp_path / 'tiny-lama'}" in result.stderr and "neither a local directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "tiny-lama").exists() and not (tmp_path / "automodel_logs").exists(), "nothing started"


def test_init_config_keeps_existing_files_unless_forced(tmp_path: Path) -> None:
    config_path = write_example_config("sft", tmp_path)
    config_path.write_text("# edited\n")
    with pytest.raises(FileExistsError, match=r"sft\.yaml.*already exist.*--force"):
        write_example_config("sft", tmp_path)
    assert config_path.read_text() == "# edited\n"
    write_example_config("sft", tmp_path, force=True)
    assert yaml.safe_load(config_path.read_text())["recipe"] == "sft"


def test_init_config_command_exits_2_on_existing_files(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "automodel.training.cli", "init-config", "pretrain", "--output", str(tmp_path)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "automodel pretrain --config" in first.stdout, first.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr


def _run(command: list[str | Path], *, cwd: Path, timeout: int, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def _build(tmp_path: Path) -> tuple[Path, Path]:
    """The sdist and the wheel, built from a copy of the sources (the checkout stays untouched)."""
    sources = tmp_path / "sources"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, sources / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, sources / name)
    _run([sys.executable, "-m", "build", "--outdir", tmp_path / "dist", sources], cwd=tmp_path, timeout=600)
    (sdist,) = (tmp_path / "dist").glob("automodel-*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("automodel-*.whl")
    return sdist, wheel


def _check_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"automodel", "model_sidecars", "automodel-0.1.0.dist-info"}
    for required in (
        "automodel/_compat/torch.py",
        "automodel/training/examples/sft.yaml",
        "automodel/training/examples/data/smol_chat.jsonl",
        "model_sidecars/__init__.py",
    ):
        assert required in names, required
    assert not any("tests" in Path(name).parts or name.startswith("recipes/") for name in names)


@pytest.mark.slow
@pytest.mark.distributed
def test_wheel_works_in_a_fresh_virtualenv_outside_the_repo(tmp_path: Path) -> None:
    _, wheel = _build(tmp_path)
    _check_wheel_contents(wheel)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path, timeout=300)
    # The distributions' own versions ("2.13.0+cpu" from a local wheel; "2.14.1", not torch's "2.14.1+cu130").
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("torch", "transformers")]
    _run([venv / "bin" / "pip", "install", "--quiet", wheel, *pins], cwd=tmp_path, timeout=900)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    automodel = venv / "bin" / "automodel"
    help_text = _run([automodel, "--help"], cwd=elsewhere, env=env, timeout=300)
    assert "`automodel sft --help`" in help_text and "init-config" in help_text
    assert "config keys of `automodel sft`" in _run([automodel, "sft", "--help"], cwd=elsewhere, env=env, timeout=300)

    _run([automodel, "init-config", "sft", "--output", "configs"], cwd=elsewhere, env=env, timeout=300)
    trained = _run(
        [automodel, "sft", "--config", "configs/sft.yaml", "--nproc-per-node", "2"], cwd=elsewhere, env=env, timeout=600
    )
    assert "automodel sft: 4 steps" in trained and (elsewhere / "configs/out/sft/export/config.json").is_file(), trained

    shutil.copy(REPO / "tests" / "wheel" / "parity.py", elsewhere / "parity.py")
    torchrun = [venv / "bin" / "torchrun", "--standalone", "--nproc-per-node", "2"]
    parity = _run([*torchrun, "parity.py", "configs/tiny-llama"], cwd=elsewhere, env=env, timeout=600)
    assert "parity ok" in parity and f"automodel from {venv}" in parity, parity


def test_every_test_file_is_placed_in_or_out_of_the_compat_run_on_purpose():
    """``make test-compat`` runs the files tools/compat_tests.txt lists; every other test file is in
    tools/compat_left_out.txt with why. A new file must be put in one of them."""

    def listed(name: str) -> list[str]:
        lines = (REPO / "tools" / name).read_text().splitlines()
        return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]

    compat, left_out = listed("compat_tests.txt"), listed("compat_left_out.txt")
    files = sorted(path.name for path in (REPO / "tests").glob("test_*.py"))
    assert not set(compat) & set(left_out), sorted(set(compat) & set(left_out))
    assert sorted(compat + left_out) == files, (
        f"not placed: {sorted(set(files) - set(compat) - set(left_out))}; "
        f"listed but missing: {sorted(set(compat + left_out) - set(files))}"
    )
