"""Rank-side cases for the recipes (run inside ``tests.harness.RankPool`` workers), and the tiny chat checkpoint
they train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from automodel.distributed.pipelined_model import PipelinedModel
from automodel.training.config import load_config
from automodel.training.loop import run
from automodel.training.tiny_model import word_level_tokenizer
from tests.tiny_models import build_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
CHAT_DATA = REPO / "recipes" / "data" / "smol_chat.jsonl"


def save_tiny_chat_checkpoint(directory: str | Path, architecture: str = "llama", **overrides: Any) -> Path:
    """A tiny random model whose vocabulary covers the shipped chat set, with its tokenizer, saved for from_pretrained
    (``overrides``: config values, e.g. a wider model, and ``seed``)."""
    directory = Path(directory)
    texts = ["system user assistant"]
    for line in CHAT_DATA.read_text().splitlines():
        record = json.loads(line)
        texts += [m["content"] for m in record.get("messages", [])] + [
            record.get("prompt", ""),
            record.get("completion", ""),
        ]
    tokenizer = word_level_tokenizer(texts)
    config = _tiny_config(
        architecture,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        max_position_embeddings=128,
        **{key: value for key, value in overrides.items() if key != "seed"},
    )
    build_model(config, seed=overrides.get("seed", 0)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _tiny_config(architecture: str, **values: Any):
    """The tiny config of a zoo architecture (``tests.tiny_models``) or of a sidecar model (``nemotron_h``,
    ``qwen3_5``: the configs their sidecar tests use)."""
    if architecture == "nemotron_h":
        from tests.cases.sidecar_nemotron_h import tiny_config as sidecar_config
    elif architecture == "qwen3_5":
        from tests.cases.sidecar_qwen3_5 import tiny_config as sidecar_config
    else:
        return tiny_config(architecture, **values)
    return sidecar_config(**values)


def train(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Run a recipe on every rank; the step losses and facts about the trained model."""
    result = run(load_config(config_path, overrides))
    facts = {"losses": result.losses, "resumed_from": result.resumed_from, "export_dir": result.export_dir}
    if result.export_dir is not None and not isinstance(result.model, PipelinedModel):
        facts["export_logits"] = _export_matches(result)
    return facts


def exports_differ(first: str, second: str) -> float:
    """Max |logits| difference between two exports, both loaded by plain transformers (on the calling rank)."""
    from transformers import AutoModelForCausalLM

    batch = torch.arange(1, 17).reshape(2, 8)
    logits = []
    for directory in (first, second):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=batch % model.config.vocab_size).logits)
    return (logits[0] - logits[1]).abs().max().item()


def _export_matches(result) -> float | None:
    """Max |logits(export loaded by plain transformers) - logits(trained sharded model)| on rank 0's batch."""
    from transformers import AutoModelForCausalLM

    model = result.model
    batch = torch.arange(1, 17).reshape(2, 8) % model.config.vocab_size
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.to(next(model.parameters()).device)).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        logits = logits.float().cpu()
    if dist.get_rank() != 0:
        return None
    plain = AutoModelForCausalLM.from_pretrained(result.export_dir).eval()
    with torch.no_grad():
        return (plain(input_ids=batch).logits.float() - logits).abs().max().item()


def _adapter_matches(result, base: str, adapter: Path) -> float | None:
    """Max |logits(plain base + the exported ``adapter`` through peft) - logits(trained sharded model)| on rank 0."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = result.model.eval()
    batch = torch.arange(1, 17).reshape(2, 8) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=batch).logits
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float()
    if dist.get_rank() != 0:
        return None
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        return (plain(input_ids=batch).logits.float() - logits).abs().max().item()


def train_with_a_crash_during_save(config_path: str, overrides: list[str], crash_step: int) -> dict[str, Any]:
    """Run a recipe whose checkpoint write of ``crash_step`` dies after the files are written but before the
    checkpoint is committed (as a kill at that moment would; with ``checkpoint.async=true``, in the background);
    report what is left on disk."""
    import automodel.training.checkpoint as checkpoint

    original, original_async = checkpoint.dcp.save, checkpoint.dcp.async_save
    dying = f"step_{crash_step:08d}"

    def dying_save(state, *, checkpoint_id):
        original(state, checkpoint_id=checkpoint_id)
        if dying in str(checkpoint_id):
            raise RuntimeError("killed while writing a checkpoint")

    class DyingFuture:
        def __init__(self, future):
            self.future = future

        def result(self):
            self.future.result()
            raise RuntimeError("killed while writing a checkpoint")

    def dying_async_save(state, *, checkpoint_id, process_group):
        future = original_async(state, checkpoint_id=checkpoint_id, process_group=process_group)
        return DyingFuture(future) if dying in str(checkpoint_id) else future

    checkpoint.dcp.save, checkpoint.dcp.async_save = dying_save, dying_async_save
    try:
        run(load_config(config_path, overrides))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    finally:
        checkpoint.dcp.save, checkpoint.dcp.async_save = original, original_async
    config = load_config(config_path, overrides)
    directory = Path(config.checkpoint.dir)
    return {
        "error": error,
        "entries": sorted(path.name for path in directory.iterdir()),
        "latest": checkpoint.latest_checkpoint(directory).name,
        "pointer": (directory / checkpoint.LATEST).read_text().strip(),
    }


def train_lora(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Run a LoRA recipe; also report whether the base weights stayed exactly the checkpoint's, and, for an
    adapter-only export, whether peft loads it onto plain transformers with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    config = load_config(config_path, overrides)
    result = run(config)
    if config.export.lora == "adapter":
        return {
            "losses": result.losses,
            "adapter_logits": _adapter_matches(result, config.model.path, result.export_dir),
            "adapter_files": sorted(path.name for path in Path(result.export_dir).iterdir()),
        }
    facts = {"losses": result.losses, "export_logits": _export_matches(result) if result.export_dir else None}
    if config.export.lora == "both":  # the adapter in export/adapter, beside the merged checkpoint
        facts["adapter_logits"] = _adapter_matches(result, config.model.path, Path(result.export_dir) / "adapter")
    if dist.get_rank() == 0 and result.export_dir:
        base = AutoModelForCausalLM.from_pretrained(config.model.path)
        exported = AutoModelForCausalLM.from_pretrained(result.export_dir)
        changed = {
            name for name, param in exported.named_parameters() if not torch.equal(param, base.get_parameter(name))
        }
        facts["changed_weights"] = sorted(changed)
    return facts


def grad_norm_matches_plain(layout: dict[str, Any]) -> dict[str, float]:
    """``clip_grad_norm``'s global norm over sharded gradients (FSDP x TP meshes) vs the norm of the same gradients in
    one plain process, and the clipped gradients vs the plainly clipped ones."""
    import copy

    from torch.distributed.tensor import DTensor

    from automodel.distributed import MeshContext, ModelParallelizer
    from automodel.training.optim import clip_grad_norm
    from tests.tiny_models import token_batch

    context = MeshContext.build(**layout)
    reference = build_model(tiny_config("llama"))
    model = ModelParallelizer().parallelize(copy.deepcopy(reference), context)
    batch = token_batch()
    reference(input_ids=batch, labels=batch).loss.backward()
    rows = batch.shape[0] // context.dp_size
    local = batch[context.mesh("dp").get_local_rank() * rows :][:rows]
    model(input_ids=local, labels=local).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    norm = clip_grad_norm(model.parameters(), 0.5)
    ref_grads = dict(reference.named_parameters())
    clipped = max(
        ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - ref_grads[n].grad).abs().max().item()
        for n, p in model.named_parameters()
    )
    return {"norm": norm.item(), "expected": expected.item(), "clipped": clipped}


def train_and_report(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Run a recipe; its losses, learning rates, validation losses and the training log (rank 0), and, with a
    validation set and an export, plain transformers' mean token loss of the exported model on that set."""
    import logging

    from automodel.training.data import load_records, tokenize_sft

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    training_logger = logging.getLogger("automodel.training")
    training_logger.addHandler(handler)
    training_logger.setLevel(logging.INFO)
    try:
        config = load_config(config_path, overrides)
        result = run(config)
    finally:
        training_logger.removeHandler(handler)
    facts = {
        "losses": result.losses,
        "learning_rates": result.learning_rates,
        "eval_losses": result.eval_losses,
        "log": records,
        "resumed_from": result.resumed_from,
    }
    if dist.get_rank() == 0 and result.export_dir and config.data.validation_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(result.export_dir)
        exported = AutoModelForCausalLM.from_pretrained(result.export_dir).eval()
        examples = tokenize_sft(load_records(config.data.validation_path), tokenizer, config.train.seq_len)
        total, count = 0.0, 0
        with torch.no_grad():
            for example in examples:
                ids = torch.tensor([example.input_ids])
                labels = torch.tensor([example.labels])
                targets = int((labels[:, 1:] != -100).sum())
                if targets:
                    total += exported(input_ids=ids, labels=labels).loss.item() * targets
                    count += targets
        facts["reference_eval_loss"] = total / count
    return facts


def reloaded_export_logits(export_dir: str, layout: dict[str, Any]) -> float | None:
    """Max |logits(the export loaded by ``from_pretrained`` parallelized for ``layout``) - logits(the export in plain
    transformers)| on rank 0's batch."""
    from transformers import AutoModelForCausalLM

    from automodel import MeshContext, NeMoAutoModelForCausalLM

    model = NeMoAutoModelForCausalLM.from_pretrained(
        export_dir, mesh_context=MeshContext.build(**layout), dtype=torch.float32
    ).eval()
    batch = torch.arange(1, 17).reshape(2, 8) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=batch).logits
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float()
    if dist.get_rank() != 0:
        return None
    plain = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return (plain(input_ids=batch).logits.float() - logits).abs().max().item()


def resume_error(config_path: str, overrides: list[str]) -> str:
    """Run a recipe expected to refuse its resume; the error this rank raised (its class and message)."""
    try:
        run(load_config(config_path, overrides))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
