"""Recipe configs: YAML + dotted overrides into typed sections; every bad key or value is a clear error, raised
before any process starts (the `automodel` command exits 2 without launching torchrun)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from automodel.training.config import ConfigError, check_world_size, load_config
from tests.conftest import REPO

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
    assert config.checkpoint.every_steps == 10 and config.model.path == "some/model"  # a hub id stays one
    assert config.export.dir == str(config_file.parent / "out")  # relative to the YAML file's folder
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
        ("layout.reshard_after_forward=sometimes", "layout.reshard_after_forward='sometimes' is not one of"),
        ("train.grad_sync=sometimes", "train.grad_sync='sometimes' is not one of"),
        ("data.packing=maybe", "data.packing='maybe' must be true or false"),
        ("model.path=", "model.path"),
        ("checkpoint.dir=null", "checkpoint.every_steps is set but checkpoint.dir is not"),
        ("train.warmup_steps=31", "train.warmup_steps=31 must be in [0, train.max_steps]"),
        ("train.hang_timeout_s=-1", "train.hang_timeout_s=-1.0 must be 0 (no watchdog) or more"),
        ("train.weight_decay=-1", "train.weight_decay=-1.0 must be >= 0"),
        ("train.betas=[1.5, 0.95]", "train.betas=[1.5, 0.95]: each of AdamW's two betas must be in [0, 1)"),
        ("train.betas=[0.9, 1.0]", "must be in [0, 1)"),
        ("train", "is not `dotted.key=value`"),
        ("train.log_every=0", "train.log_every=0 must be at least 1"),
        ("train.seq_len=1", "train.seq_len=1 leaves no token to predict"),
    ],
)
def test_bad_keys_and_values_name_the_key(config_file, override, message):
    with pytest.raises(ConfigError) as error:
        load_config(config_file, [override])
    assert message in str(error.value)


@pytest.mark.parametrize("layout", ["layout.strategy=megatron_fsdp", "layout.pp_size=2"])
def test_grad_sync_per_micro_batch_is_refused_where_the_layout_chooses_it(config_file, layout):
    with pytest.raises(ConfigError, match="train.grad_sync=micro_batch runs with layout.strategy=fsdp2 or ddp"):
        load_config(config_file, ["train.grad_sync=micro_batch", layout])
    assert (
        load_config(config_file, ["train.grad_sync=micro_batch", "layout.strategy=ddp"]).train.grad_sync
        == "micro_batch"
    )


def test_reshard_policy_names_map_to_fsdp2_config(config_file):
    """torchtitan's names: ``default`` (also spelled ``all_but_last``) is the default, then ``always`` and ``never``."""
    from automodel.training.loop import mesh_arguments

    def strategy(*overrides):
        return mesh_arguments(load_config(config_file, ["layout.strategy=fsdp2", *overrides]).layout)["strategy"]

    assert load_config(config_file, []).layout.reshard_after_forward == "default"
    assert strategy().reshard_after_forward is None
    assert strategy("layout.reshard_after_forward=all_but_last").reshard_after_forward is None
    assert strategy("layout.reshard_after_forward=always").reshard_after_forward is True
    assert strategy("layout.reshard_after_forward=never").reshard_after_forward is False


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
    assert load_config(config_file, ["lora.rank=8", "layout.tp_size=2", "layout.sequence_parallel=true"]).lora.rank == 8
    assert load_config(config_file, ["lora.rank=8", "export.lora=both"]).export.lora == "both"
    with pytest.raises(ConfigError, match="megatron_fsdp"):
        load_config(config_file, ["lora.rank=8", "layout.strategy=megatron_fsdp"])
    with pytest.raises(ConfigError, match=r"lora.dropout=2.0 must be in \[0, 1\)"):
        load_config(config_file, ["lora.rank=8", "lora.dropout=2"])
    with pytest.raises(ConfigError, match="needs LoRA adapters"):
        load_config(config_file, ["export.lora=adapter"])
    with pytest.raises(ConfigError, match="not pretraining"):
        load_config(config_file, ["lora.rank=8", "recipe=pretrain"])


def test_relative_paths_in_the_yaml_are_relative_to_its_folder(tmp_path, monkeypatch):
    (tmp_path / "models" / "local").mkdir(parents=True)
    (tmp_path / "recipe.yaml").write_text(BASE.replace("some/model", "models/local"))
    monkeypatch.chdir(tmp_path.parent)  # anywhere else
    config = load_config(tmp_path / "recipe.yaml", ["export.dir=elsewhere"])
    assert config.data.path == str(tmp_path / "data.jsonl") and config.checkpoint.dir == str(tmp_path / "ckpt")
    assert config.model.path == str(tmp_path / "models" / "local")  # exists there: a local directory
    assert config.export.dir == "elsewhere"  # a command-line path is relative to the current directory
    (tmp_path / "recipe.yaml").write_text(BASE.replace("some/model", "./not-yet"))
    assert load_config(tmp_path / "recipe.yaml").model.path == str(tmp_path / "not-yet")  # "./": a path


@pytest.mark.parametrize(
    ("overrides", "processes", "message"),
    [
        (["layout.tp_size=3"], 2, "layout does not fit 2 processes: dp_replicate_size * cp_size * tp_size = 1 * 1 * 3"),
        (["layout.strategy=ddp", "layout.tp_size=2"], 2, "layout does not fit 2 processes: The DDP strategy"),
        (
            [],
            8,
            "train.global_batch_size=8 must be a multiple of train.micro_batch_size * the data-parallel size = 2 * 8",
        ),
    ],
    ids=["tp_does_not_divide", "ddp_with_tp", "batch_too_small"],
)
def test_the_layout_is_checked_against_the_process_count(config_file, overrides, processes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_world_size(load_config(config_file, overrides), processes)
    check_world_size(load_config(config_file), 2)


def _automodel(*args: str, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "automodel.training.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_an_impossible_layout_exits_2_before_launching(config_file):
    result = _automodel("sft", "--config", str(config_file), "--nproc-per-node", "2", "layout.tp_size=3")
    assert result.returncode == 2, result.stderr
    assert "config error: layout does not fit 2 processes" in result.stderr and "tp_size = 1 * 1 * 3" in result.stderr
    assert "torch.distributed.run" not in result.stderr


def test_every_config_key_has_a_one_line_meaning():
    from automodel.training.config_help import KEY_MEANINGS, config_keys

    assert set(KEY_MEANINGS) == set(config_keys())
    assert all("\n" not in meaning and len(meaning) <= 110 for meaning in KEY_MEANINGS.values())


def test_help_lists_the_keys_and_print_config_the_resolved_config(config_file):
    help_text = _automodel("sft", "--help").stdout
    assert "config keys of `automodel sft` (key = default, then its meaning" in help_text
    assert re.search(r"^  train\.lr = 0\.0001 +peak learning rate \(AdamW\)$", help_text, re.MULTILINE), help_text
    assert re.search(r"^  lora\.rank = 0 +LoRA adapter rank", help_text, re.MULTILINE), help_text
    pretrain = _automodel("pretrain", "--help").stdout
    assert "config keys of `automodel pretrain`" in pretrain and "  layout.tp_size = 1 " in pretrain
    assert "lora." not in pretrain and "data.packing" not in pretrain, "SFT's own keys are not pretraining's"
    assert "`automodel sft --help` also lists every config key" in _automodel("--help").stdout
    printed = _automodel("sft", "--config", str(config_file), "--print-config", "train.lr=3e-4")
    assert printed.returncode == 0, printed.stderr
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["train"]["lr"] == 3e-4 and resolved["data"]["path"] == str(config_file.parent / "data.jsonl")


@pytest.mark.distributed
def test_the_tiny_recipe_runs_from_any_directory(tmp_path):
    """recipes/sft_tiny.yaml as shipped (copied with its data so its outputs land here), run from another folder: the
    tiny model is written on first use, trained on 2 ranks and exported."""
    recipes = tmp_path / "project" / "recipes"
    (recipes / "data").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "sft_tiny.yaml", recipes)
    shutil.copy(REPO / "recipes" / "data" / "smol_chat.jsonl", recipes / "data")
    (tmp_path / "elsewhere").mkdir()
    result = _automodel(
        "sft", "--config", str(recipes / "sft_tiny.yaml"), "--nproc-per-node", "2", cwd=tmp_path / "elsewhere"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "automodel sft: 4 steps" in result.stdout, result.stdout
    assert (tmp_path / "project" / "out" / "tiny-llama" / "tokenizer.json").is_file()
    assert (tmp_path / "project" / "out" / "sft-tiny" / "export" / "model.safetensors").is_file()


def test_checkpoint_async_is_the_key_though_async_is_a_python_keyword(config_file):
    config = load_config(config_file, ["checkpoint.dir=ckpt", "checkpoint.async=true"])
    assert config.checkpoint.async_ is True
    assert config.to_dict()["checkpoint"]["async"] is True  # the dump loads back
    assert load_config(config_file).checkpoint.async_ is False
    with pytest.raises(ConfigError, match=re.escape("checkpoint accepts ['async', 'dir', 'every_steps', 'keep']")):
        load_config(config_file, ["checkpoint.async_=true"])


def test_the_model_card_lists_the_layout_choices_not_its_defaults(config_file):
    """The card of a run without a pipeline has no pp_schedule; the strategy is always there, other keys only when
    set to something else than their default (the pipeline's schedule keys with a pipeline)."""
    from automodel.training.export_step import training_summary

    plain = training_summary(load_config(config_file, ["layout.tp_size=2", "layout.pp_schedule=gpipe"]))["layout"]
    assert plain == {"strategy": "fsdp2", "tp_size": 2}, plain
    pipelined = training_summary(load_config(config_file, ["layout.pp_size=2", "layout.pp_schedule=gpipe"]))["layout"]
    assert pipelined == {"strategy": "fsdp2", "pp_size": 2, "pp_schedule": "gpipe"}, pipelined


def test_a_loss_that_is_not_a_number_stops_the_run_at_its_step():
    import torch

    from automodel.training.loop import _check_finite

    _check_finite(3, 2.5, torch.tensor(1.0))
    for loss in (float("nan"), float("inf")):
        with pytest.raises(
            FloatingPointError, match=rf"step 3: the loss is {loss} \(gradient norm nan\): training diverged"
        ):
            _check_finite(3, loss, torch.tensor(float("nan")))


def test_a_key_written_twice_in_the_yaml_is_refused_at_its_line(tmp_path):
    """YAML keeps the last of two equal keys; a second ``train:`` section would drop the whole first one."""
    (tmp_path / "twice.yaml").write_text(BASE + "train:\n  lr: 0.1\n")
    second = len(BASE.splitlines()) + 1
    first = next(number for number, line in enumerate(BASE.splitlines(), 1) if line.startswith("train:"))
    with pytest.raises(ConfigError, match=rf"twice.yaml:{second}: train is written twice \(first at line {first}\)"):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "inner.yaml").write_text(BASE.replace("lr: 1.0e-4}", "lr: 1.0e-4, lr: 0.5}"))
    with pytest.raises(ConfigError, match=r"train\.lr is written twice"):
        load_config(tmp_path / "inner.yaml")


def test_a_string_key_takes_the_text_yaml_reads_as_a_number_or_a_date(config_file):
    config = load_config(config_file, ["model.revision=1234", "log.mlflow.run_name=2024-06-01"])
    assert (config.model.revision, config.log.mlflow.run_name) == ("1234", "2024-06-01")
    with pytest.raises(ConfigError, match=r'model.revision=True must be a string: quote it \(revision: "True"\)'):
        load_config(config_file, ["model.revision=true"])
