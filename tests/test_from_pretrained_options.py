"""``from_pretrained``'s keyword arguments follow transformers: loading options honoured, options a mesh replaces and
quantization refused with the reason, config attributes overridden, anything else a ``TypeError`` that names it."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.loading import MissingCheckpointFileError
from tests.tiny_models import build_model, tiny_config, token_batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("options") / "llama"
    build_model(tiny_config("llama")).save_pretrained(directory)
    return directory


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=token_batch(batch_size=2)).logits


def test_unknown_keyword_is_a_type_error_with_close_matches(checkpoint):
    with pytest.raises(TypeError, match=r"'bogus_kwarg_xyz'") as error:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, bogus_kwarg_xyz=1)
    assert "neither loading options nor attributes of LlamaConfig" in str(error.value)
    with pytest.raises(TypeError, match=r"'rms_norm_epss' \(did you mean 'rms_norm_eps'\?\)"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, rms_norm_epss=1e-3)
    with pytest.raises(TypeError, match=r"'use_safetensor' \(did you mean 'use_safetensors'"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, use_safetensor=True)


def test_config_attributes_are_overridden_as_in_transformers(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, rms_norm_eps=1e-3)
    assert model.config.rms_norm_eps == 1e-3
    assert AutoModelForCausalLM.from_pretrained(checkpoint, rms_norm_eps=1e-3).config.rms_norm_eps == 1e-3


def test_without_a_mesh_the_refusal_says_what_loads_instead(checkpoint):
    """No mesh_context was passed: the refusal does not speak of one being combined, it says where the model goes."""
    with pytest.raises(ValueError) as error:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto")
    message = str(error.value)
    assert "cannot be combined with a mesh" not in message, message
    assert message.startswith("from_pretrained(device_map=...) is not supported here: this library places the model")
    assert "Without mesh_context it loads the whole model on the CPU" in message and "MeshContext.build" in message


@pytest.mark.parametrize(
    ("keyword", "value", "expected"),
    [
        ("load_in_8bit", True, "asks to quantize the model while loading, which is not supported"),
        ("load_in_4bit", True, "asks to quantize the model while loading"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "asks to quantize the model while loading"),
        ("device_map", "auto", "is not supported here: this library places the model itself"),
        ("max_memory", {0: "1GB"}, "(it sizes a device_map; with a mesh every rank holds only its own shards)"),
        ("offload_folder", "/tmp/x", "cpu_offload=True"),
        ("tp_size", 2, "MeshContext.build(tp_size=...)"),
        ("low_cpu_mem_usage", False, "always built on the meta device"),
        ("gguf_file", "model.gguf", "convert them to safetensors first"),
        ("ignore_mismatched_sizes", True, "give the config the checkpoint's sizes"),
        ("weights_only", False, "always unpickled with weights_only=True"),
        ("output_loading_info", True, "rank 0 logs what was loaded"),
    ],
)
def test_options_a_mesh_replaces_and_quantization_are_refused(checkpoint, keyword, value, expected):
    with pytest.raises(ValueError, match=rf"from_pretrained\({keyword}=") as error:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, **{keyword: value})
    assert expected in str(error.value), error.value


# transformers' defaults of the options refused above: they ask for nothing, and wrappers pass them always (TRL passes
# device_map=None and quantization_config=None).
OFF_VALUES = {
    "device_map": None,
    "quantization_config": None,
    "max_memory": None,
    "offload_buffers": False,
    "load_in_8bit": False,
    "output_loading_info": False,
    "ignore_mismatched_sizes": False,
    "gguf_file": None,
    "key_mapping": None,
    "state_dict": None,
    "adapter_name": "default",
    "weights_only": True,
    "low_cpu_mem_usage": None,
    "offload_state_dict": True,  # transformers ignores it altogether
}


def test_the_values_that_ask_for_nothing_are_accepted(checkpoint):
    with pytest.raises(ValueError, match=r"low_cpu_mem_usage=False\) is not supported"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, low_cpu_mem_usage=False)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, **OFF_VALUES)
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(checkpoint)))


def test_a_config_object_or_folder_replaces_the_checkpoints_config(checkpoint, tmp_path):
    config = AutoConfig.from_pretrained(checkpoint)
    config.rms_norm_eps = 1e-2
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, config=config, use_cache=False)
    assert model.config.rms_norm_eps == 1e-2 and model.config.use_cache is False
    assert config.use_cache is True, "the caller's config object was changed"
    assert model.config.name_or_path == str(checkpoint)
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(checkpoint, config=config)))
    config.save_pretrained(tmp_path)
    from_folder = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, config=tmp_path)
    assert from_folder.config.rms_norm_eps == 1e-2 and torch.equal(_logits(from_folder), _logits(model))
    with pytest.raises(TypeError, match="'rms_norm_epss'"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, config=config, rms_norm_epss=1e-3)


def test_transformers_names_of_the_arguments(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path=checkpoint)
    assert model.name_or_path == model.config.name_or_path == str(checkpoint)
    with pytest.warns(FutureWarning, match="different dtypes per module is deprecated"):
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, dtype={"": torch.bfloat16})
    assert model.dtype == torch.bfloat16


def test_low_cpu_mem_usage_true_is_what_loading_does_anyway(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, low_cpu_mem_usage=True)
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(checkpoint)))


def test_tp_plan_auto_means_the_models_own_plan(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, tp_plan="auto")
    assert not hasattr(model, "_automodel_user_tp_plan")


def test_dtype_wins_over_torch_dtype_with_transformers_warning(checkpoint):
    with pytest.warns(FutureWarning, match=r"`torch_dtype` is deprecated! Use `dtype` instead!"):
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, torch_dtype=torch.float16)
    assert model.dtype == torch.bfloat16
    # transformers logs the same sentence (as a logger warning) and lets dtype win too.
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, torch_dtype=torch.float16)
    assert reference.dtype == torch.bfloat16


def test_subfolder(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "repo" / "weights" / "main")
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="weights/main")
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(checkpoint)))
    with pytest.raises(FileNotFoundError, match="has no subfolder 'nope'"):
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="nope")


def test_variant_selects_the_weight_files(tmp_path):
    build_model(tiny_config("llama"), seed=3).save_pretrained(tmp_path, variant="ema", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.ema.json").is_file()
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path, variant="ema")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, variant="ema")
    assert torch.equal(_logits(model), _logits(reference))
    with pytest.raises(MissingCheckpointFileError, match="No weights in"):
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path)


def test_use_safetensors_chooses_between_safetensors_and_bin(tmp_path):
    build_model(tiny_config("llama"), seed=4).save_pretrained(tmp_path)  # model.safetensors
    bin_model = build_model(tiny_config("llama"), seed=5)
    torch.save(bin_model.state_dict(), tmp_path / "pytorch_model.bin")  # other weights, as a .bin
    preferred = NeMoAutoModelForCausalLM.from_pretrained(tmp_path)
    forced_bin = NeMoAutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=False)
    assert torch.equal(_logits(preferred), _logits(AutoModelForCausalLM.from_pretrained(tmp_path)))
    assert torch.equal(_logits(forced_bin), _logits(bin_model.eval()))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(MissingCheckpointFileError, match=r"\(use_safetensors=True\)"):
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=True)


def test_generation_config_argument(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, generation_config=GenerationConfig(max_new_tokens=7))
    assert model.generation_config.max_new_tokens == 7


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_paused_during_a_load_and_left_as_it_was(checkpoint, enabled):
    """``from_pretrained`` runs with Python's cyclic collector off (its walks over the load's objects cost up to
    14 ms of a 1.2 GB load) and leaves it on or off as the caller had it, also when the load fails."""
    states = []
    original = NeMoAutoModelForCausalLM._build_on_meta.__func__

    def build(cls, *args):
        states.append(gc.isenabled())
        return original(cls, *args)

    previous = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(NeMoAutoModelForCausalLM, "_build_on_meta", classmethod(build))
            NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
            assert gc.isenabled() is enabled
            with pytest.raises(TypeError, match="not_an_option"):
                NeMoAutoModelForCausalLM.from_pretrained(checkpoint, not_an_option=1)
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if previous else gc.disable)()
    assert states == [False]
