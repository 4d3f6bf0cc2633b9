"""``NeMoAutoDiffusionPipeline``: a tiny random Flux pipeline saved locally loads with its transformer parallelized
(FSDP2 on 2 and 4 CPU ranks, the transformer blocks as FSDP units), the same diffusers pipeline class with the other
components plain; the transformer and one denoising step of the whole pipeline match the plain pipeline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from automodel.diffusion import NeMoAutoDiffusionPipeline
from automodel.loading import CheckpointError, plan_checkpoint
from tests.cases.diffusion import (
    denoising_step,
    fsdp_parity,
    qwen_image_parity,
    save_parity,
    save_tiny_flux_pipeline,
    save_tiny_qwen_image_transformer,
    save_variant_pipeline,
    tensor_parallel_error,
    torch_dtype_parity,
    variant_parity,
)

TOLERANCE = 1e-4
# FSDP modules in module order: the root, then the double- and single-stream transformer blocks (nothing else).
BLOCK_UNITS = [
    "",
    "transformer_blocks.0",
    "transformer_blocks.1",
    "single_transformer_blocks.0",
    "single_transformer_blocks.1",
]


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> str:
    return str(save_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux")))


def test_saved_transformer_is_sharded(pipeline_dir):
    index = json.loads(
        (Path(pipeline_dir) / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text()
    )
    assert len(set(index["weight_map"].values())) > 1


def _assert_parallel_pipeline(result: dict) -> None:
    assert result["pipeline_class"] == "FluxPipeline" and result["transformer_is_flux"], result
    assert result["config_entry"] == ["diffusers", "FluxTransformer2DModel"], result["config_entry"]
    assert result["transformer_sharded"] and not result["on_meta"], result
    assert result["units"] == BLOCK_UNITS, result["units"]
    assert all(result["others_plain"].values()), result["others_plain"]
    assert result["transformer_scale"] > 0.1, "a vanishing output would hide a wrong shard"
    assert result["transformer_diff"] <= TOLERANCE, result
    assert result["step_diff"] <= TOLERANCE and result["step_shape"] == (1, 16, 4), result


@pytest.mark.distributed
def test_fsdp2_on_2_ranks(ranks2, pipeline_dir):
    for result in ranks2.run(fsdp_parity, pipeline_dir, {"strategy": "fsdp2"}):
        _assert_parallel_pipeline(result)


@pytest.mark.distributed
def test_fsdp2_on_4_ranks_and_tp_is_a_clear_error(ranks4, pipeline_dir):
    for result in ranks4.run(fsdp_parity, pipeline_dir, {"strategy": "fsdp2"}):
        _assert_parallel_pipeline(result)
    for message in ranks4.run(tensor_parallel_error, pipeline_dir):
        assert "PackedRowwiseParallel" in message and "tp_size=1" in message, message


@pytest.mark.distributed
def test_tensor_parallel_from_the_class_plan(ranks4, tmp_path):
    directory = str(save_tiny_qwen_image_transformer(tmp_path / "transformer"))
    for result in ranks4.run(qwen_image_parity, directory, {"strategy": "fsdp2", "tp_size": 2}):
        # colwise / rowwise; `attn.to_out.0` is one element of a list, beside a dropout.
        assert (result["to_q_tp"], result["to_out_tp"]) == ("S(0)", "S(1)"), result
        assert result["scale"] > 0.1 and result["diff"] <= TOLERANCE, result


@pytest.mark.distributed
def test_torch_dtype_applies_to_the_parallelized_component(ranks2, pipeline_dir):
    for result in ranks2.run(torch_dtype_parity, pipeline_dir):
        assert set(result["dtypes"].values()) == {"torch.bfloat16"}, result["dtypes"]
        assert result["sharded"] and result["scale"] > 0.1 and result["diff"] == 0.0, result


def test_dtype_and_torch_dtype_must_agree(pipeline_dir):
    with pytest.raises(ValueError, match="disagree"):
        NeMoAutoDiffusionPipeline.from_pretrained(pipeline_dir, dtype=torch.float16, torch_dtype=torch.bfloat16)


@pytest.mark.distributed
@pytest.mark.parametrize("legacy", [False, True], ids=["variant_names", "legacy_variant_names"])
def test_variant_loads_the_variant_files(ranks2, pipeline_dir, tmp_path, legacy):
    directory = str(save_variant_pipeline(Path(pipeline_dir), tmp_path / "with_fp16", legacy=legacy))
    index = "diffusion_pytorch_model.safetensors." + ("fp16.index.json" if legacy else "index.fp16.json")
    assert (Path(directory) / "transformer" / index).is_file()
    for result in ranks2.run(variant_parity, directory):
        # diffusers casts the fp16 files to its default float32; a wrong file shows as the halved weights' difference
        assert result["sharded"] and result["dtype"] == result["reference_dtype"] == "torch.float32", result
        assert result["diff"] <= TOLERANCE and result["step_diff"] <= TOLERANCE, result
        assert result["diff_to_plain_weights"] > 0.1, result
        assert "variant='bf16'" in result["missing_variant"], result["missing_variant"]


@pytest.mark.distributed
def test_save_pretrained_of_the_parallelized_pipeline(ranks2, pipeline_dir, tmp_path):
    for result in ranks2.run(save_parity, pipeline_dir, str(tmp_path)):
        assert "safe_serialization=False" in result["refusal"] and not result["refused_written"], result
        assert result["variant_diff"] <= TOLERANCE, result
        for name in ("single", "sharded"):
            saved = result[name]
            assert saved["pipeline_class"] == "FluxPipeline", saved
            assert saved["transformer_class"] == saved["config_class"] == "FluxTransformer2DModel", saved
            assert saved["transformer_diff"] <= TOLERANCE and saved["step_diff"] <= TOLERANCE, saved
            assert "model_index.json" in saved["top"] and not [f for f in saved["top"] if f.startswith(".")], saved
        assert result["single"]["files"] == ["config.json", "diffusion_pytorch_model.safetensors"]
        sharded = result["sharded"]["files"]
        assert "diffusion_pytorch_model.safetensors" not in sharded, sharded
        assert "diffusion_pytorch_model.safetensors.index.json" in sharded and len(sharded) > 3, sharded
        assert "diffusion_pytorch_model.fp16.safetensors" in sharded, sharded


def test_without_mesh_context_the_pipeline_is_plain(pipeline_dir):
    pipe = NeMoAutoDiffusionPipeline.from_pretrained(pipeline_dir, components_to_load=["transformer"])
    assert type(pipe) is FluxPipeline and type(pipe.transformer) is FluxTransformer2DModel
    assert not any(isinstance(p, DTensor) for p in pipe.transformer.parameters())
    reference = FluxPipeline.from_pretrained(pipeline_dir)
    assert torch.equal(denoising_step(pipe), denoising_step(reference))


def test_unknown_component_lists_the_components(pipeline_dir):
    with pytest.raises(ValueError, match="unet") as error:
        NeMoAutoDiffusionPipeline.from_pretrained(pipeline_dir, components_to_load=["unet"])
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "scheduler"):
        assert f"'{name}'" in str(error.value)
    with pytest.raises(ValueError, match="not torch modules"):
        NeMoAutoDiffusionPipeline.from_pretrained(pipeline_dir, components_to_load=["scheduler"])


def test_mismatched_keys_name_them(pipeline_dir, tmp_path):
    tensors = {}
    source = Path(pipeline_dir) / "transformer"
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(shard))
    tensors["proj_out.renamed"] = tensors.pop("proj_out.weight")
    save_file(tensors, tmp_path / "diffusion_pytorch_model.safetensors")
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(source))
    with pytest.raises(CheckpointError) as error:
        plan_checkpoint(model, tmp_path)
    assert "proj_out.weight" in str(error.value) and "proj_out.renamed" in str(error.value)


def test_missing_diffusers_says_how_to_install(monkeypatch, pipeline_dir):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "automodel\[diffusion\]"'):
        NeMoAutoDiffusionPipeline.from_pretrained(pipeline_dir)


def test_import_automodel_does_not_import_diffusers():
    code = (
        "import sys, automodel; cls = automodel.NeMoAutoDiffusionPipeline; "
        "assert cls.__name__ == 'NeMoAutoDiffusionPipeline'; assert 'diffusers' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
