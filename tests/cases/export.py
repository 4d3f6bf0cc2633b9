"""Rank-side cases for ``automodel.loading.export`` (run inside ``tests.harness.RankPool`` workers)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import MeshContext
from automodel.distributed.runtime import full_tensor
from automodel.loading.export import ModelCardInfo, save_hf_checkpoint
from tests.tiny_models import token_batch


def sgd_step(model: torch.nn.Module, lr: float = 0.5) -> None:
    """One training step on the same batch on every rank, so the exported weights differ from the checkpoint."""
    model.train()
    batch = token_batch(seed=7)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def stored_keys(directory: Path) -> list[str]:
    """Every tensor name in the safetensors files of ``directory`` (duplicates kept, to reveal them)."""
    keys = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            keys.extend(handle.keys())
    return keys


def describe_export(directory: Path, reference_checkpoint: str) -> dict[str, Any]:
    """Facts about an export: its files, index, stored keys and the keys ``save_pretrained`` of the same model writes."""
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    with tempfile.TemporaryDirectory() as plain_dir:
        AutoModelForCausalLM.from_pretrained(reference_checkpoint).save_pretrained(plain_dir)
        plain_keys = sorted(stored_keys(Path(plain_dir)))
    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            files[file.name] = sorted(handle.keys())
    return {
        "files": sorted(p.name for p in directory.iterdir()),
        "weight_map": index["weight_map"] if index else None,
        "index_metadata": index["metadata"] if index else None,
        "file_keys": files,
        "stored_keys": stored_keys(directory),
        "save_pretrained_keys": plain_keys,
        "architectures": json.loads((directory / "config.json").read_text())["architectures"],
    }


def export_parity(
    checkpoint: str, layout: dict[str, Any], directory: str, max_shard_size: str
) -> dict[str, Any] | None:
    """Load ``checkpoint`` for ``layout``, train one step, export; on rank 0 load the export with plain transformers
    and compare its logits with the sharded model's (rank 0 returns the facts, the others None)."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    sgd_step(model)
    batch = token_batch()
    with torch.no_grad():
        sharded_logits = full_tensor(model(batch).logits).detach()
    card = ModelCardInfo(base_model="org/tiny-base", training_summary={"recipe": "sft", "layout": layout})
    path = save_hf_checkpoint(model, directory, max_shard_size=max_shard_size, model_card=card)
    if dist.get_rank() != 0:
        return None
    exported = AutoModelForCausalLM.from_pretrained(path)
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        logits = exported(batch).logits
        before = original(batch).logits
    facts = describe_export(path, checkpoint)
    facts["logits"] = (logits - sharded_logits).abs().max().item()
    facts["moved_by_training"] = (before - sharded_logits).abs().max().item()
    facts["tied"] = exported.get_input_embeddings().weight is exported.get_output_embeddings().weight
    facts["on_meta"] = [name for name, p in exported.named_parameters() if p.is_meta]
    return facts


def export_refused(checkpoint: str, directory: str) -> str:
    """The error ``save_hf_checkpoint`` raises on this rank when ``directory`` exists and is not empty."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build("fsdp2"))
    try:
        save_hf_checkpoint(model, directory)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def save_pretrained_parity(checkpoint: str, layout: dict[str, Any], directory: str) -> dict[str, Any] | None:
    """Load ``checkpoint`` for ``layout``, train one step and call ``save_pretrained`` on every rank, as transformers'
    distributed docs do; on rank 0 load the result with plain transformers and compare logits (rank 0 returns the
    facts, the others None). With context parallelism (whose forward needs sharded sequences) the loaded model is
    saved untrained and compared with the checkpoint."""
    context = MeshContext.build(**layout)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=context)
    batch = token_batch()
    if context.cp_size == 1:
        sgd_step(model)
        with torch.no_grad():
            sharded_logits = full_tensor(model(batch).logits).detach()
    else:
        with torch.no_grad():
            sharded_logits = AutoModelForCausalLM.from_pretrained(checkpoint)(batch).logits
    model.save_pretrained(directory, max_shard_size="40KB")
    if dist.get_rank() != 0:
        return None
    saved = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = saved(batch).logits
    return {
        "same_class": isinstance(model, type(saved)),
        "files": sorted(path.name for path in Path(directory).iterdir()),
        "logits": (logits - sharded_logits).abs().max().item(),
        "stored_keys": sorted(stored_keys(Path(directory))),
        "plain_keys": describe_export(Path(directory), checkpoint)["save_pretrained_keys"],
    }


def save_pretrained_error(checkpoint: str, **kwargs: Any) -> str:
    """The error ``save_pretrained(..., **kwargs)`` of a parallelized model raises on this rank."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build("fsdp2"))
    try:
        model.save_pretrained(tempfile.mkdtemp(), **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def push_to_hub_offline(checkpoint: str) -> dict[str, Any]:
    """``push_to_hub`` on every rank of a parallelized model where the hub cannot be reached (its repo creation
    replaced by the connection error an offline machine gets): this rank's error, and the folder of rank 0's
    checkpoint, which every rank's error must name and which is kept for a later upload."""
    from huggingface_hub import HfApi

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known")

    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, mesh_context=MeshContext.build("fsdp2"))
    original, HfApi.create_repo = HfApi.create_repo, unreachable
    try:
        model.push_to_hub("org/tiny")
        message = "no error"
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    finally:
        HfApi.create_repo = original
    folder = [None]
    if dist.get_rank() == 0:
        written = Path(tempfile.gettempdir()).glob("automodel-push-*/checkpoint")
        folder = [max(written, key=lambda path: path.stat().st_mtime, default=None)]  # this call's: the newest
    dist.broadcast_object_list(folder, src=0)
    kept = folder[0] is not None and (folder[0] / "config.json").is_file()
    return {"message": message, "folder": str(folder[0]), "kept": kept}


def export_bytes(
    checkpoint: str,
    layout: dict[str, Any],
    directory: str,
    max_shard_size: str,
    *,
    vision: bool = False,
    shared_staging: bool = True,
) -> dict[str, Any]:
    """Load ``checkpoint`` for ``layout`` and ``save_pretrained`` it on every rank; report the bytes this rank wrote
    itself, and (rank 0) the digest of every file. ``shared_staging=False`` makes the ranks other than 0 not see the
    staging directory (as on nodes without a shared file system)."""
    from unittest import mock

    from automodel.loading import parallel_export

    loader = _loaders(vision)[0]
    model = loader.from_pretrained(checkpoint, mesh_context=MeshContext.build(**layout), dtype=torch.float32)
    written = []
    real = parallel_export.write_box

    def counted(fd, start, shape, offsets, data):
        written.append(data.numel() * data.element_size())
        real(fd, start, shape, offsets, data)

    unseen = dist.get_rank() != 0 and not shared_staging
    with (
        mock.patch.object(parallel_export, "write_box", counted),
        mock.patch.object(parallel_export, "_has_size", lambda path, size: False)
        if unseen
        else contextlib.nullcontext(),
    ):
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    facts: dict[str, Any] = {"bytes_written": sum(written)}
    if dist.get_rank() == 0:
        facts["digests"] = file_digests(Path(directory))
    return facts


def one_process_export(checkpoint: str, directory: str, max_shard_size: str, *, vision: bool = False) -> dict:
    """The digests of the export of plain transformers' load of ``checkpoint`` in this one process (no sharding)."""
    model = _loaders(vision)[1].from_pretrained(checkpoint, dtype=torch.float32)
    save_hf_checkpoint(model, directory, max_shard_size=max_shard_size)
    return file_digests(Path(directory))


def file_digests(directory: Path) -> dict[str, str]:
    """The sha256 of every weight file and of the index in ``directory``."""
    import hashlib

    files = [*directory.glob("*.safetensors"), *directory.glob("*.index.json")]
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(files)}


def _loaders(vision: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    from automodel.auto_model import NeMoAutoModelForImageTextToText

    if vision:
        return NeMoAutoModelForImageTextToText, AutoModelForImageTextToText
    return NeMoAutoModelForCausalLM, AutoModelForCausalLM
