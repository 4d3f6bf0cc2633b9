"""The SFT / pretraining loop: model from the auto classes, data, AdamW, accumulation, clipping, checkpoints, export.

``run(config)`` is what ``automodel sft|pretrain`` executes on every rank (under torchrun).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.distributed import FSDP2Config, MeshContext
from automodel.distributed.context_parallel import shard_batch_for_context_parallel

from .batches import DistributedBatchLoader
from .checkpoint import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import RecipeConfig
from .data import load_records, load_texts, pack_examples, tokenize_pretraining, tokenize_sft
from .optim import clip_grad_norm, make_optimizer, make_scheduler
from .packing import check_packed_attention
from .tiny_model import write_tiny_model

__all__ = ["TrainResult", "build_mesh_context", "run", "train_step"]

logger = logging.getLogger("automodel.training")


@dataclass
class TrainResult:
    """What a run did: the loss of every step it trained (resumed steps included from the checkpoint)."""

    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0
    export_dir: str | None = None
    model: nn.Module | None = None


def build_mesh_context(config: RecipeConfig) -> MeshContext:
    """The ``MeshContext`` the layout section describes."""
    layout = config.layout
    strategy: str | FSDP2Config = layout.strategy
    if layout.mixed_precision == "bf16":
        if layout.strategy != "fsdp2":
            raise ValueError("layout.mixed_precision=bf16 is implemented with FSDP2: set layout.strategy=fsdp2.")
        strategy = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MeshContext.build(
        strategy,
        dp_replicate_size=layout.dp_replicate_size,
        tp_size=layout.tp_size,
        cp_size=layout.cp_size,
        ep_size=layout.ep_size,
        sequence_parallel=layout.sequence_parallel,
        activation_checkpointing=layout.activation_checkpointing,
    )


def _build_model(config: RecipeConfig, context: MeshContext) -> nn.Module:
    model = config.model
    dtype = getattr(torch, model.dtype)
    if config.recipe == "pretrain":
        hf_config = AutoConfig.from_pretrained(
            model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
        return NeMoAutoModelForCausalLM.from_config(
            hf_config,
            mesh_context=context,
            dtype=dtype,
            seed=config.train.seed,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
        )
    return NeMoAutoModelForCausalLM.from_pretrained(
        model.path,
        mesh_context=context,
        dtype=dtype,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        attn_implementation=model.attn_implementation,
        peft_config=_lora_config(config),
    )


def _lora_config(config: RecipeConfig):
    lora = config.lora
    if lora.rank == 0:
        return None
    from peft import LoraConfig

    # peft's shorthand for every linear layer but the output head is the bare string.
    targets = "all-linear" if lora.target_modules == ("all-linear",) else list(lora.target_modules)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)


def _build_loader(config: RecipeConfig, tokenizer, context: MeshContext) -> DistributedBatchLoader:
    train, data = config.train, config.data
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if config.recipe == "pretrain":
        examples = tokenize_pretraining(load_texts(data.path), tokenizer, train.seq_len)
    else:
        examples = tokenize_sft(load_records(data.path), tokenizer, train.seq_len)
        if data.packing:
            examples = pack_examples(examples, train.seq_len, pad_id)
    return DistributedBatchLoader(
        examples,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp_rank=context.mesh("dp").get_local_rank(),
        dp_size=context.dp_size,
        seq_len=train.seq_len,
        pad_id=pad_id,
        seed=data.seed,
    )


def _valid_targets(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss after the causal shift."""
    return (labels[:, 1:] != -100).sum()


def train_step(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], context: MeshContext) -> torch.Tensor:
    """Forward and backward over this rank's micro batches; returns the step's global mean token loss.

    Each micro batch's loss is its token-loss sum divided by (the step's valid tokens over all data-parallel ranks /
    the ranks gradients are averaged over), so the averaged gradient is the mean over every token of the global
    batch, however tokens fall into micro batches, ranks and context-parallel shards.
    """
    device = next(model.parameters()).device
    valid = torch.stack([_valid_targets(batch["labels"]) for batch in micro_batches]).sum().float().to(device)
    dist.all_reduce(valid, group=context.mesh("dp").get_group())  # on the device: NCCL reduces device tensors only
    averaged_over = context.size("dp_cp")
    num_items = (valid / averaged_over).to(device)
    total = torch.zeros((), device=device)
    for index, batch in enumerate(micro_batches):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        inputs = model_inputs(batch, context, device)
        loss = model(**inputs, num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total, group=context.mesh("dp_cp").get_group())
    return total / averaged_over


def model_inputs(batch: dict[str, torch.Tensor], context: MeshContext, device: torch.device) -> dict:
    """The forward arguments of a collated micro batch: this CP rank's part of it under CP, ``position_ids`` of
    packed sequences (transformers then masks each packed example to itself), and no KV cache (training)."""
    if context.cp_size == 1:
        inputs = {"input_ids": batch["input_ids"].to(device), "labels": batch["labels"].to(device)}
        if "position_ids" in batch:
            inputs["position_ids"] = batch["position_ids"].to(device)
        return {**inputs, "use_cache": False}
    local = shard_batch_for_context_parallel(
        batch["input_ids"], batch["labels"], context.mesh("cp"), batch.get("position_ids")
    )
    return {
        "input_ids": local["input_ids"].to(device),
        "position_ids": local["position_ids"].to(device),
        "labels": local["shift_labels"].to(device),
        "shift_labels": local["shift_labels"].to(device),
        "use_cache": False,
    }


def prepare_model(config: RecipeConfig) -> None:
    """With ``model.tiny_if_missing``, write the tiny smoke-test model to ``model.path`` when nothing is there (on rank 0
    when a process group runs, the others waiting for it)."""
    path = Path(config.model.path)
    if not config.model.tiny_if_missing or (path / "config.json").is_file():
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_tiny_model(path, config.data.path, seed=config.train.seed)
    if dist.is_initialized():
        dist.barrier()


def run(config: RecipeConfig) -> TrainResult:
    """Train as ``config`` says; resume from the newest complete checkpoint in ``checkpoint.dir`` if there is one."""
    train = config.train
    context = build_mesh_context(config)
    prepare_model(config)
    torch.manual_seed(train.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path, revision=config.model.revision)
    model = _build_model(config, context)
    model.train()
    if config.data.packing and config.recipe == "sft":
        check_packed_attention(model, context, tolerance=_packing_tolerance(config))
    loader = _build_loader(config, tokenizer, context)
    optimizer = make_optimizer(model, train)
    scheduler = make_scheduler(optimizer, train)
    result = TrainResult()
    resume = latest_checkpoint(config.checkpoint.dir)
    if resume is not None:
        state = load_checkpoint(resume, model, optimizer)
        scheduler.load_state_dict(state.scheduler)
        loader.load_state_dict(state.data)
        torch.set_rng_state(state.rng)
        result.losses, result.resumed_from = list(state.losses), state.step
    writer = _tensorboard(config)
    is_main = dist.get_rank() == 0
    last = train.max_steps
    if train.stop_after_steps is not None:
        last = min(last, result.resumed_from + train.stop_after_steps)
    bar = tqdm(range(result.resumed_from, last), desc=config.recipe, disable=not is_main)
    for step in bar:
        start = time.perf_counter()
        micro_batches = loader.next_global_batch()
        loss = train_step(model, micro_batches, context)
        norm = clip_grad_norm(model.parameters(), train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        seconds = time.perf_counter() - start
        result.losses.append(loss.item())
        tokens = train.global_batch_size * train.seq_len
        _log(step + 1, result.losses[-1], lr, norm.item(), tokens / seconds, seconds, bar, writer, train.log_every)
        if _should_save(config, step + 1, last):
            state = TrainerState(
                step + 1, scheduler.state_dict(), loader.state_dict(), torch.get_rng_state(), result.losses
            )
            save_checkpoint(config.checkpoint.dir, model, optimizer, state, keep=config.checkpoint.keep)
    if writer is not None:
        writer.close()
    result.model = model
    if config.export.dir is not None and last == train.max_steps:
        result.export_dir = str(_export(config, model, tokenizer))
    return result


def _packing_tolerance(config: RecipeConfig) -> float:
    """How far a packed document's logits may be from the document alone: rounding only (fp32 or bf16 compute)."""
    reduced = config.model.dtype != "float32" or config.layout.mixed_precision == "bf16"
    return 5e-2 if reduced else 1e-3


def _should_save(config: RecipeConfig, step: int, last: int) -> bool:
    """Checkpoint every ``checkpoint.every_steps`` and at this run's last step (``max_steps`` or an early stop)."""
    every, directory = config.checkpoint.every_steps, config.checkpoint.dir
    if directory is None:
        return False
    return step == last or (every > 0 and step % every == 0)


def _log(step, loss, lr, norm, tokens_per_s, seconds, bar, writer, every) -> None:
    if dist.get_rank() != 0 or step % every:
        return
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
    logger.info(
        "step %d | loss %.4f | lr %.3e | grad norm %.3f | %.0f tokens/s | %.2f s",
        step,
        loss,
        lr,
        norm,
        tokens_per_s,
        seconds,
    )
    if writer is not None:
        for name, value in (("loss", loss), ("lr", lr), ("grad_norm", norm), ("tokens_per_s", tokens_per_s)):
            writer.add_scalar(f"train/{name}", value, step)


def _tensorboard(config: RecipeConfig):
    if config.train.tensorboard_dir is None or dist.get_rank() != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(config.train.tensorboard_dir)


def _export(config: RecipeConfig, model: nn.Module, tokenizer):
    from automodel.loading.export import ModelCardInfo, save_hf_checkpoint

    summary = {
        "recipe": config.recipe,
        "steps": config.train.max_steps,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.train.seq_len,
        "lr": config.train.lr,
        "layout": {k: v for k, v in config.to_dict()["layout"].items() if v not in (1, False, None)},
        "data": config.data.path,
    }
    if config.lora.rank:
        from automodel.lora import merge_lora
        from automodel.lora_checkpoint import save_lora_adapter

        summary["lora"] = {"rank": config.lora.rank, "alpha": config.lora.alpha, "targets": config.lora.target_modules}
        export = Path(config.export.dir)
        if config.export.lora == "adapter":
            return _publish(config, _export_adapter(model, export, tokenizer))
        if config.export.lora == "both":  # the adapter first: merging folds it away
            adapter = save_lora_adapter(model, export.parent / f".{export.name}.adapter")
        model = merge_lora(model)  # the merged export is a plain checkpoint: adapters folded into the weights
    info = ModelCardInfo(base_model=config.model.path, training_summary=summary, tags=(config.recipe,))
    directory = save_hf_checkpoint(
        model,
        config.export.dir,
        tokenizer=tokenizer,
        max_shard_size=config.export.max_shard_size,
        model_card=info,
        model_id=config.export.push_to_hub,
        overwrite=True,
    )
    if config.lora.rank and config.export.lora == "both":
        if dist.get_rank() == 0:
            os.replace(adapter, directory / "adapter")
        dist.barrier()
    return _publish(config, directory)


def _export_adapter(model: nn.Module, directory: Path, tokenizer) -> Path:
    """The adapter alone (as peft's save_pretrained writes it) and the tokenizer beside it, as peft users keep them."""
    from automodel.lora_checkpoint import save_lora_adapter

    directory = save_lora_adapter(model, directory)
    if tokenizer is not None and dist.get_rank() == 0:
        tokenizer.save_pretrained(directory)
    dist.barrier()
    return directory


def _publish(config: RecipeConfig, directory: Path) -> Path:
    if config.export.push_to_hub and dist.get_rank() == 0:
        from automodel.loading.export import push_to_hub

        push_to_hub(directory, config.export.push_to_hub)
    return directory
