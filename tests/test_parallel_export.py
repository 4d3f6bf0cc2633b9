"""The consolidated export written by every rank at once (``automodel.loading.parallel_export``): byte for byte the
files plain transformers' ``save_pretrained`` writes, on every layout, with every rank writing its own shards.

The single-process tests pin the two building blocks: the safetensors header computed from shapes alone equals
``save_file``'s, and a box of a tensor written run by run lands where the whole tensor's bytes would.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from automodel.loading.region_writes import write_box
from automodel.loading.safetensors_layout import file_layout
from tests.cases import sidecar_nemotron_h
from tests.cases.export import export_bytes, file_digests, one_process_export
from tests.quantized_checkpoints import dequantized_path, write_fp8_checkpoint
from tests.tiny_models import save_tiny_checkpoint
from tests.vlm_models import save_tiny_vlm

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn]  # fmt: skip


def test_the_header_from_shapes_alone_is_save_files_byte_for_byte():
    generator = random.Random(0)
    for _ in range(200):
        tensors = {}
        for number in range(generator.randint(0, 6)):
            shape = [generator.randint(0, 4) for _ in range(generator.randint(0, 3))]
            name = generator.choice(["a", "model.layers.9.w", "model.layers.10.w", "lm_head.weight", "é"])
            tensors[f"{name}{number}"] = (torch.rand(shape) * 5).to(generator.choice(DTYPES))
        metadata = generator.choice([None, {"format": "pt"}])
        layout = file_layout({name: tensor.to("meta") for name, tensor in tensors.items()}, metadata)
        written = bytearray(layout.size)
        written[: len(layout.header)] = layout.header
        for name, tensor in tensors.items():
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            written[layout.offsets[name] : layout.offsets[name] + len(data)] = data
        assert bytes(written) == save(tensors, metadata=metadata)


@pytest.mark.parametrize("shape", [(12,), (6, 8), (4, 6, 10), (3, 4, 5, 6)])
def test_boxes_written_run_by_run_make_the_whole_tensor(tmp_path, shape):
    """Every split of every dimension in two (a dim-0 shard is one run, a dim-1 shard one run per row, ...)."""
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    path = tmp_path / "tensor.bin"
    start = 5  # an offset in the file, as after a header
    for cuts in itertools.product(*[(0, size // 3, size) for size in shape]):
        path.write_bytes(b"\0" * (start + whole.numel() * 4))
        fd = os.open(path, os.O_WRONLY)
        try:
            for corner in itertools.product(*[(0, 1)] * len(shape)):
                box = [
                    (0, cut) if side == 0 else (cut, size) for side, cut, size in zip(corner, cuts, shape, strict=True)
                ]
                part = whole[tuple(slice(a, b) for a, b in box)]
                write_box(fd, start, shape, [a for a, _ in box], part)
        finally:
            os.close(fd)
        written = torch.frombuffer(bytearray(path.read_bytes()[start:]), dtype=torch.float32).reshape(shape)
        assert torch.equal(written, whole), cuts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel_export")
    made = {arch: str(save_tiny_checkpoint(arch, folder / arch)) for arch in ("llama", "llama_tied", "llama_uneven",
                                                                               "mixtral", "qwen3_moe")}  # fmt: skip
    made["nemotron_h"] = sidecar_nemotron_h.save_checkpoint(str(folder / "nemotron_h"))
    made["llava"] = str(save_tiny_vlm("llava", folder / "llava"))
    write_fp8_checkpoint("llama", folder / "llama_fp8")
    made["llama_fp8"] = str(folder / "llama_fp8")
    return made


FSDP2 = {"strategy": "fsdp2"}
HSDP = {"strategy": "fsdp2", "dp_replicate_size": 2}
TP2 = {"strategy": "fsdp2", "tp_size": 2}
EP2 = {"strategy": "fsdp2", "ep_size": 2}
#: (checkpoint, layout, world); every case on 4 ranks but TP=2 alone (2 ranks).
CASES = {
    "llama-fsdp2": ("llama", FSDP2, 4),
    "llama-hsdp": ("llama", HSDP, 4),
    "llama-tp2": ("llama", TP2, 2),
    "llama-fsdp2_x_tp2": ("llama", TP2, 4),
    "llama-ddp": ("llama", {"strategy": "ddp"}, 2),
    "llama_uneven-fsdp2_x_tp2": ("llama_uneven", TP2, 4),
    "llama_tied-fsdp2_x_tp2": ("llama_tied", TP2, 4),
    "llama_tied-hsdp": ("llama_tied", HSDP, 4),
    "mixtral-ep2": ("mixtral", EP2, 4),
    "mixtral-fsdp2_x_tp2": ("mixtral", TP2, 4),
    "qwen3_moe-ep2": ("qwen3_moe", EP2, 4),
    "nemotron_h-fsdp2": ("nemotron_h", FSDP2, 4),
    "nemotron_h-tp2": ("nemotron_h", TP2, 2),
    "llava-fsdp2": ("llava", FSDP2, 4),
    "llava-fsdp2_x_tp2": ("llava", TP2, 4),
    "llama_fp8-fsdp2_x_tp2": ("llama_fp8", TP2, 4),
}


#: The cells on the quick suite (dim-0 shards with rowwise runs, replicas, gathered experts, a sidecar's renames); the
#: rest (DDP, uneven shards, a VLM, a dequantized load, ...) in the slow matrix.
QUICK = {"llama-fsdp2_x_tp2", "llama_tied-hsdp", "mixtral-ep2", "nemotron_h-tp2"}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=[] if case in QUICK else [pytest.mark.slow]) for case in CASES]
)
def test_the_export_is_the_one_process_export_byte_for_byte_written_by_every_rank(request, checkpoints, tmp_path, case):
    name, layout, world = CASES[case]
    vision = name == "llava"
    pool = request.getfixturevalue(f"ranks{world}")
    results = pool.run(export_bytes, checkpoints[name], layout, str(tmp_path / "export"), "40KB", vision=vision)
    # Plain transformers' load of the same checkpoint (of the fp8 one's unquantized twin: the values its codes mean),
    # exported in one process: nothing sharded, nothing gathered.
    plain = str(dequantized_path(checkpoints[name])) if name == "llama_fp8" else checkpoints[name]
    reference = one_process_export(plain, str(tmp_path / "reference"), "40KB", vision=vision)
    assert results[0]["digests"] == reference
    written = [result["bytes_written"] for result in results]
    total = sum((tmp_path / "export" / name).stat().st_size for name in reference if name.endswith(".safetensors"))
    assert all(written), f"every rank writes its share: {written}"
    assert sum(written) < total, "each byte is written once (rank 0 writes the headers besides)"
    if layout is FSDP2 and name not in {"llava", "nemotron_h"}:  # every tensor sharded: about a quarter each
        assert max(written) < 0.4 * total, written


def test_the_one_process_export_of_a_dense_model_is_save_pretrained_byte_for_byte(checkpoints, tmp_path):
    """Where no conversion applies, ``save_pretrained``'s own files (with experts transformers' split counts the
    whole storage its per-expert views share: the same tensors, other shard boundaries)."""
    reference = tmp_path / "plain"
    for name in ("llama", "llama_tied", "llama_uneven"):
        AutoModelForCausalLM.from_pretrained(checkpoints[name]).save_pretrained(reference / name, max_shard_size="40KB")
        ours = one_process_export(checkpoints[name], str(tmp_path / name), "40KB")
        assert ours == file_digests(reference / name), name


@pytest.mark.distributed
def test_without_a_shared_staging_directory_rank_zero_writes_everything(ranks4, checkpoints, tmp_path):
    results = ranks4.run(
        export_bytes, checkpoints["llama"], TP2, str(tmp_path / "export"), "40KB", shared_staging=False
    )
    assert results[0]["digests"] == one_process_export(checkpoints["llama"], str(tmp_path / "reference"), "40KB")
    assert [result["bytes_written"] for result in results[1:]] == [0, 0, 0]
