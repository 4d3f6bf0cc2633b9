"""Every bad input of ``NeMoAutoModelForCausalLM.from_pretrained`` fails with a message that says what is wrong and how
to fix it, on every rank, without leaving a rank waiting; ``.bin``-only and ``strict=False`` loads are correct.

The checkpoints are tiny models saved here with ``save_pretrained`` and then damaged the way real downloads and
edits go wrong. In-process cases use ``mesh_context=None``; distributed cases run on 2 CPU gloo ranks with FSDP2 and
give every case a short timeout, so a rank stuck in a collective fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.cases import loading_errors as cases
from tests.tiny_models import VOCAB, save_tiny_checkpoint

FSDP2 = {"strategy": "fsdp2"}
FSDP2_TP2 = {"strategy": "fsdp2", "tp_size": 2}
TIMEOUT_S = 90.0  # a hang shows up as a RankFailure after this long, not after the 300 s collective timeout
HANG_TIMEOUT_S = 30.0  # a tiny 2-rank load takes well under 1 s: a case over this has hung
SHARDS = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
DAMAGED_SHARD = SHARDS[1]
MISSING_KEY = "model.layers.0.mlp.gate_proj.weight"
EXTRA_KEY = "model.extra.weight"


# --------------------------------------------------------------------------------------------------- checkpoints


def _copy(good: Path, root: Path, name: str) -> Path:
    return Path(shutil.copytree(good, root / name))


def _edit_config(directory: Path, **changes) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _state_dict(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _without_weights(good: Path, root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir()
    for filename in ("config.json", "generation_config.json"):
        shutil.copy(good / filename, directory)
    return directory


def _single_file(good_single: Path, root: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    directory = _copy(good_single, root, name)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _bin_sharded(good: Path, root: Path, name: str) -> Path:
    """``pytorch_model-0000k-of-00002.bin`` + ``pytorch_model.bin.index.json``, as transformers 4 wrote them
    (transformers 5.24's ``save_pretrained`` ignores ``safe_serialization=False`` and always writes safetensors)."""
    directory = _without_weights(good, root, name)
    tensors = _state_dict(good)
    keys = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), start=1):
        filename = f"pytorch_model-{number:05d}-of-00002.bin"
        torch.save({key: tensors[key] for key in part}, directory / filename)
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every checkpoint the tests load, good and bad, by name."""
    root = tmp_path_factory.mktemp("checkpoints")
    good = save_tiny_checkpoint("llama", root / "good")
    assert sorted(p.name for p in good.glob("*.safetensors")) == SHARDS
    single = save_tiny_checkpoint("llama", root / "single", max_shard_size="10MB")
    shard_bytes = (good / DAMAGED_SHARD).read_bytes()
    made = {"good": good, "single": single}

    made["missing_shard"] = _copy(good, root, "missing_shard")
    (made["missing_shard"] / DAMAGED_SHARD).unlink()
    made["truncated_shard"] = _copy(good, root, "truncated_shard")
    (made["truncated_shard"] / DAMAGED_SHARD).write_bytes(shard_bytes[: len(shard_bytes) // 2])
    made["corrupt_shard"] = _copy(good, root, "corrupt_shard")
    (made["corrupt_shard"] / DAMAGED_SHARD).write_bytes(random.Random(0).randbytes(len(shard_bytes)))
    made["bad_header"] = _copy(good, root, "bad_header")  # the 8-byte length is right, the JSON after it is not
    (made["bad_header"] / DAMAGED_SHARD).write_bytes(shard_bytes[:8] + b"{not json" + shard_bytes[17:])
    made["header_cut"] = _copy(good, root, "header_cut")  # cut inside the JSON header
    (made["header_cut"] / DAMAGED_SHARD).write_bytes(shard_bytes[:40])
    made["empty_shard"] = _copy(good, root, "empty_shard")
    (made["empty_shard"] / DAMAGED_SHARD).write_bytes(b"")
    made["bad_index"] = _copy(good, root, "bad_index")
    (made["bad_index"] / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": ')
    made["bad_config"] = _copy(good, root, "bad_config")
    (made["bad_config"] / "config.json").write_text("")  # a truncated download
    made["bad_generation_config"] = _copy(good, root, "bad_generation_config")
    (made["bad_generation_config"] / "generation_config.json").write_text('{"bos_token_id": 1,')
    made["stale_index"] = _copy(good, root, "stale_index")  # the index sends a key to a shard that lacks it
    index = json.loads((good / "model.safetensors.index.json").read_text())
    index["weight_map"][MISSING_KEY] = next(f for f in SHARDS if f != index["weight_map"][MISSING_KEY])
    (made["stale_index"] / "model.safetensors.index.json").write_text(json.dumps(index))
    made["no_weights"] = _without_weights(good, root, "no_weights")
    made["no_config"] = _copy(good, root, "no_config")
    (made["no_config"] / "config.json").unlink()

    made["shape_mismatch"] = _edit_config(_copy(good, root, "shape_mismatch"), intermediate_size=48)
    made["unknown_architecture"] = _edit_config(
        _copy(good, root, "unknown_architecture"), model_type="definitely_not_a_model"
    )
    made["remote_code"] = _edit_config(
        _copy(good, root, "remote_code"),
        model_type="definitely_not_a_model",
        auto_map={
            "AutoConfig": "configuration_secret.SecretConfig",
            "AutoModelForCausalLM": "modeling_secret.SecretForCausalLM",
        },
    )
    made["missing_key"] = _single_file(single, root, "missing_key", lambda tensors: tensors.pop(MISSING_KEY))
    made["unexpected_key"] = _single_file(
        single, root, "unexpected_key", lambda tensors: tensors.update({EXTRA_KEY: torch.randn(4, 32)})
    )

    made["bin_single"] = _without_weights(good, root, "bin_single")
    torch.save(_state_dict(good), made["bin_single"] / "pytorch_model.bin")
    made["bin_legacy"] = _without_weights(good, root, "bin_legacy")  # pre-torch-1.6 pickle format: cannot be mmapped
    torch.save(_state_dict(good), made["bin_legacy"] / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    made["bin_sharded"] = _bin_sharded(good, root, "bin_sharded")
    made["truncated_bin"] = _without_weights(good, root, "truncated_bin")
    torch.save(_state_dict(good), made["truncated_bin"] / "pytorch_model.bin")
    bin_bytes = (made["truncated_bin"] / "pytorch_model.bin").read_bytes()
    (made["truncated_bin"] / "pytorch_model.bin").write_bytes(bin_bytes[: len(bin_bytes) // 2])

    made["gpt2"] = _save_tiny_gpt2(root / "gpt2")
    made["mamba"] = _save_tiny_mamba(root / "mamba")
    return made


def _save_tiny_gpt2(directory: Path) -> Path:
    """GPT-2: a decoder-only model whose class has no ``_tp_plan`` and whose config no ``base_model_tp_plan``."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = AutoModelForCausalLM.from_config(config)
    assert not getattr(type(model), "_tp_plan", None) and not model.config.base_model_tp_plan
    model.save_pretrained(directory)
    return directory


def _save_tiny_mamba(directory: Path) -> Path:
    """Mamba: no TP plan of its own, and none derivable (its mixer's ``in_proj`` feeds another linear layer)."""
    from tests.causal_lm_zoo import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("mamba")).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------------ bad inputs

# name -> (error type on one process, fragments the message must contain; "{dir}" is the checkpoint directory)
BAD_CHECKPOINTS: dict[str, tuple[str, list[str]]] = {
    "missing_shard": (
        "MissingCheckpointFileError",
        [DAMAGED_SHARD, "names files that are not in", "download is incomplete"],
    ),
    "truncated_shard": ("CheckpointError", ["{dir}/" + DAMAGED_SHARD, "is truncated", "Download it again"]),
    "header_cut": ("CheckpointError", ["{dir}/" + DAMAGED_SHARD, "is truncated: 40 bytes, its header alone takes"]),
    "empty_shard": ("CheckpointError", ["{dir}/" + DAMAGED_SHARD, "is truncated: 0 bytes"]),
    "corrupt_shard": ("CheckpointError", ["{dir}/" + DAMAGED_SHARD, "corrupt", "download it again"]),
    "bad_header": ("CheckpointError", ["{dir}/" + DAMAGED_SHARD, "corrupt", "header"]),
    "bad_index": ("CheckpointError", ["{dir}/model.safetensors.index.json", "is not valid JSON", "Download it again"]),
    "bad_config": ("CheckpointError", ["{dir}/config.json", "is not valid JSON", "line 1, column"]),
    "bad_generation_config": ("CheckpointError", ["{dir}/generation_config.json", "is not valid JSON"]),
    "stale_index": ("CheckpointError", [MISSING_KEY, "checkpoint index in {dir} places", "does not hold it"]),
    "no_weights": ("MissingCheckpointFileError", ["No weights in {dir}", "model.safetensors", "pytorch_model.bin"]),
    "no_config": ("FileNotFoundError", ["{dir} has no config.json", "not a transformers checkpoint"]),
    "truncated_bin": ("CheckpointError", ["{dir}/pytorch_model.bin", "truncated"]),
    "shape_mismatch": (
        "CheckpointError",
        [
            "shapes that disagree with the config",
            "model.layers.0.mlp.gate_proj.weight (checkpoint (64, 32)",
            "(48, 32)",
        ],
    ),
    "unknown_architecture": ("ValueError", ["model_type='definitely_not_a_model'", "Upgrade transformers"]),
    "remote_code": ("ValueError", ["model_type='definitely_not_a_model'", "trust_remote_code=True"]),
    "missing_key": ("CheckpointError", [f"missing from the checkpoint: {MISSING_KEY}", "strict=False"]),
    "unexpected_key": ("CheckpointError", [f"in the checkpoint but not in the model: {EXTRA_KEY}", "strict=False"]),
}


def _expected(fragments: list[str], directory: Path) -> list[str]:
    return [fragment.replace("{dir}", str(directory)) for fragment in fragments]


@pytest.mark.parametrize("name", BAD_CHECKPOINTS)
def test_bad_checkpoint_error_in_process(checkpoints, name):
    error_type, fragments = BAD_CHECKPOINTS[name]
    message = cases.load_error(str(checkpoints[name]), None)
    assert message.startswith(f"{error_type}: "), message
    for fragment in _expected(fragments, checkpoints[name]):
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", BAD_CHECKPOINTS)
def test_bad_checkpoint_error_on_every_rank(ranks2, checkpoints, name):
    error_type, fragments = BAD_CHECKPOINTS[name]
    messages = ranks2.run(cases.load_error, str(checkpoints[name]), FSDP2, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(f"{error_type}: "), messages[0]  # the same class as in one process
    for fragment in _expected(fragments, checkpoints[name]):
        assert fragment in messages[0], f"{fragment!r} not in {messages[0]!r}"


@pytest.mark.distributed
def test_missing_shard_file_is_a_file_not_found_error_on_one_rank_and_on_every_rank(ranks2, checkpoints):
    """`except FileNotFoundError` catches a missing shard whether one process or every rank of a group raises it."""
    alone = cases.load_error_bases(str(checkpoints["missing_shard"]), None)
    together = ranks2.run(cases.load_error_bases, str(checkpoints["missing_shard"]), FSDP2, timeout=TIMEOUT_S)
    for bases in (alone, *together):
        assert bases[:2] == ["MissingCheckpointFileError", "CheckpointError"], bases
        assert "FileNotFoundError" in bases and "ValueError" in bases, bases


def test_nonexistent_local_path_is_a_clear_error():
    message = cases.load_error("/nonexistent/dir", None)
    assert message == "FileNotFoundError: /nonexistent/dir is neither a local directory nor a Hugging Face model id."


def test_relative_path_that_does_not_exist_is_looked_up_offline(tmp_path):
    message = cases.load_error("no_such_org/no_such_model", None, cache_dir=str(tmp_path), local_files_only=True)
    assert message.startswith("FileNotFoundError: Model 'no_such_org/no_such_model' (revision main)"), message
    assert str(tmp_path) in message and "pass a local directory" in message


@pytest.mark.distributed
def test_failure_only_one_rank_sees_is_raised_on_every_rank(ranks2, checkpoints):
    per_rank = [str(checkpoints["good"]), str(checkpoints["truncated_shard"])]
    messages = ranks2.run(cases.load_error, per_rank, FSDP2, timeout=TIMEOUT_S)
    rank1_sees = f"CheckpointError: Checkpoint file {checkpoints['truncated_shard']}/{DAMAGED_SHARD} is truncated"
    for rank, message in enumerate(messages):  # each rank names the directory it was given
        assert message.startswith(f"CheckpointError: Checking the checkpoint in {per_rank[rank]} failed on 1 of 2 ")
        assert f"\n  rank 1: {rank1_sees}" in message and "rank 0:" not in message, message
    assert messages[0].split("rank 1: ")[1] == messages[1].split("rank 1: ")[1]


@pytest.mark.distributed
def test_missing_tp_plan_names_the_class_and_how_to_supply_one(ranks2, checkpoints):
    # Neither declared nor derivable (GPT-2, which declares none, now runs a derived plan: tests/test_zoo_sweep.py).
    messages = ranks2.run(cases.load_error, str(checkpoints["mamba"]), FSDP2_TP2, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("ValueError: MambaForCausalLM has no tensor-parallel plan"), messages[0]
    assert "`_tp_plan`" in messages[0] and "tp_shard_plan" in messages[0]
    assert "backbone.layers.*.mixer.in_proj also feeds another linear layer" in messages[0], messages[0]


def test_model_without_tp_plan_loads_without_tp(checkpoints):
    result = cases.loaded_logits(str(checkpoints["gpt2"]), None)
    assert result["class"] == "GPT2LMHeadModel" and result["logits"] <= 1e-4, result


# ------------------------------------------------------------------------------------- loads that must succeed


@pytest.mark.parametrize("name", ["bin_single", "bin_sharded", "bin_legacy"])
def test_bin_checkpoint_loads_like_transformers_in_process(checkpoints, name):
    result = cases.loaded_logits(str(checkpoints[name]), None)
    assert result["logits"] <= 1e-4 and not result["on_meta"], result


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["bin_single", "bin_sharded", "bin_legacy"])
def test_bin_checkpoint_loads_like_transformers_on_fsdp2_ranks(ranks2, checkpoints, name):
    for result in ranks2.run(cases.loaded_logits, str(checkpoints[name]), FSDP2, timeout=TIMEOUT_S):
        assert result["logits"] <= 1e-4 and not result["on_meta"] and result["sharded"] > 0, result


def test_unexpected_key_is_ignored_without_strict(checkpoints):
    result = cases.loaded_logits(str(checkpoints["unexpected_key"]), None, strict=False)
    assert result["logits"] <= 1e-4, result


@pytest.mark.distributed
def test_unexpected_key_is_ignored_without_strict_on_fsdp2_ranks(ranks2, checkpoints):
    for result in ranks2.run(cases.loaded_logits, str(checkpoints["unexpected_key"]), FSDP2, strict=False):
        assert result["logits"] <= 1e-4 and not result["on_meta"], result


def _check_initialised(value: torch.Tensor, initializer_range: float) -> None:
    assert value.shape == (64, 32)
    assert value.abs().max() > 0, "initialised to zeros"
    assert 0.8 * initializer_range <= value.std().item() <= 1.2 * initializer_range, value.std()
    assert abs(value.mean().item()) <= 0.1 * initializer_range, value.mean()


def test_missing_key_is_initialised_without_strict(checkpoints):
    result = cases.initialised_missing_tensor(str(checkpoints["missing_key"]), None, MISSING_KEY)
    _check_initialised(result["value"], AutoConfig.from_pretrained(checkpoints["missing_key"]).initializer_range)
    assert result["others"] == 0.0 and not result["on_meta"], result


@pytest.mark.distributed
def test_missing_key_is_initialised_consistently_across_fsdp2_ranks(ranks2, checkpoints):
    directory = str(checkpoints["missing_key"])
    results = ranks2.run(cases.initialised_missing_tensor, directory, FSDP2, MISSING_KEY, timeout=TIMEOUT_S)
    value = results[0]["value"]
    assert torch.equal(value, results[1]["value"]), "the ranks disagree on the initialised tensor"
    assert all(result["local_shape"] == (32, 32) for result in results), results  # really sharded over 2 ranks
    assert not torch.equal(value[:32], value[32:]), "each rank initialised its shard from the same RNG state"
    _check_initialised(value, AutoConfig.from_pretrained(directory).initializer_range)
    # the same tensor one process initialises (init does not depend on the layout)
    in_process = cases.initialised_missing_tensor(directory, None, MISSING_KEY)["value"]
    assert torch.equal(value, in_process)
    assert all(result["others"] == 0.0 and not result["on_meta"] for result in results), results


def test_strict_false_does_not_excuse_a_shape_mismatch(checkpoints):
    message = cases.load_error(str(checkpoints["shape_mismatch"]), None, strict=False)
    assert message.startswith("CheckpointError: ") and "shapes that disagree with the config" in message, message


@pytest.mark.distributed
def test_config_failure_only_one_rank_sees_is_raised_on_every_rank(ranks2, checkpoints):
    per_rank = [str(checkpoints["good"]), str(checkpoints["no_config"])]
    messages = ranks2.run(cases.load_error, per_rank, FSDP2, timeout=HANG_TIMEOUT_S)
    for message in messages:  # each rank names its own path first, then the failing rank's message
        assert "failed on 1 of 2 ranks" in message and "rank 1: FileNotFoundError" in message, messages
        assert "no_config has no config.json" in message, messages
