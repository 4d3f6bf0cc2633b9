"""Recipe configs: YAML + dotted overrides into typed sections; every bad key or value is a clear error, raised
before any process starts (the `automodel` command exits 2 without launching torchrun)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from automodel.training.config import ConfigError, load_config

BASE = """
recipe: sft
model: {path: some/model}
data: {path: data.jsonl}
train: {max_steps: 30, global_batch_size: 8, micro_batch_size: 2, seq_len: 64, lr: 1.0e-4}
checkpoint: {dir: ckpt, every_steps: 10}
export: {dir: out}
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(BASE)
    return path


def test_yaml_and_overrides_give_typed_sections(config_file):
    config = load_config(
        config_file,
        ["train.lr=3e-4", "train.max_steps=5", "layout.tp_size=2", "data.packing=true", "train.betas=[0.9, 0.99]"],
    )
    assert config.train.lr == 3e-4 and config.train.max_steps == 5 and config.layout.tp_size == 2
    assert config.data.packing is True and config.train.betas == (0.9, 0.99)
    assert config.checkpoint.every_steps == 10 and config.export.dir == "out" and config.model.path == "some/model"
    assert load_config(config_file, ["train.lr=1"]).train.lr == 1.0  # ints are accepted where floats are wanted


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.learning_rate=1e-4", "Unknown config key(s) train.learning_rate"),
        ("trian.lr=1e-4", "Unknown config key(s) trian"),
        ("train.max_steps=ten", "train.max_steps='ten' must be an integer"),
        ("train.max_steps=0", "train.max_steps=0 must be at least 1"),
        ("train.micro_batch_size=3", "must be a multiple of train.micro_batch_size=3"),
        ("layout.strategy=zero3", "layout.strategy='zero3' is not one of"),
        ("layout.activation_checkpointing=partial", "is not one of"),
        ("data.packing=maybe", "data.packing='maybe' must be true or false"),
        ("model.path=", "model.path"),
        ("checkpoint.dir=null", "checkpoint.every_steps is set but checkpoint.dir is not"),
        ("train.warmup_steps=31", "train.warmup_steps=31 must be in [0, train.max_steps]"),
        ("train", "is not `dotted.key=value`"),
    ],
)
def test_bad_keys_and_values_name_the_key(config_file, override, message):
    with pytest.raises(ConfigError) as error:
        load_config(config_file, [override])
    assert message in str(error.value)


def test_recipe_must_match_the_command(config_file):
    with pytest.raises(ConfigError, match="the command is `automodel pretrain`"):
        load_config(config_file, [], recipe="pretrain")


def test_the_command_refuses_a_bad_config_before_starting_processes(config_file):
    result = subprocess.run(
        [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(config_file), "train.lr=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "config error: train.lr=-1.0 must be > 0" in result.stderr
    assert "torch.distributed.run" not in result.stderr


def test_lora_section(config_file):
    config = load_config(config_file, ["lora.rank=8", "lora.target_modules=[q_proj, k_proj, v_proj]"])
    assert config.lora.rank == 8 and config.lora.target_modules == ("q_proj", "k_proj", "v_proj")
    assert load_config(config_file, ["lora.rank=4", "lora.target_modules=all-linear"]).lora.target_modules == (
        "all-linear",
    )
    with pytest.raises(ConfigError, match="set a positive rank"):
        load_config(config_file, ["lora.alpha=32"])
    with pytest.raises(ConfigError, match="FSDP2 path without TP or EP"):
        load_config(config_file, ["lora.rank=8", "layout.tp_size=2"])
    with pytest.raises(ConfigError, match="not pretraining"):
        load_config(config_file, ["lora.rank=8", "recipe=pretrain"])
