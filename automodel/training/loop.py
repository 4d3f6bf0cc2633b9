"""The SFT / pretraining loop: model from the auto classes, data, AdamW, accumulation, clipping, checkpoints, export.

``run(config)`` is what ``automodel sft|pretrain`` executes on every rank (under torchrun).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from automodel.auto_model import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
from automodel.distributed import MeshContext
from automodel.distributed.pipelined_model import PipelinedModel
from automodel.distributed.runtime import log_rank_zero, progress_bars_disabled
from automodel.loading.pipeline import transformers_model

from .batches import DistributedBatchLoader, PrefetchingLoader
from .checkpoint import Checkpointer
from .config import (
    ConfigError,
    RecipeConfig,
    validate_vision_language,
)
from .data import load_records, load_texts, pack_examples, tokenize_pretraining, tokenize_sft
from .evaluation import ValidationSet
from .export_step import export_trained
from .layout_arguments import build_mesh_context, mesh_arguments
from .loss import choose_loss
from .metrics import flops_per_token, model_flops_utilization
from .optim import clip_grad_norm, make_optimizer, make_scheduler
from .packing import check_packed_attention
from .preemption import PreemptionHandler
from .prepared import PreparedCorpus, PreparedExamples, is_prepared
from .prepared_reading import read_prepared, suggest_prepare_data
from .resume import frozen_base_identity, resume_if_saved, trainer_state
from .run_log import record_progress
from .step import model_inputs, train_step
from .tiny_model import write_tiny_model
from .trackers import Trackers
from .vlm import IMAGE_TEXT_TO_TEXT, model_kind, resolve_image_paths, tokenize_vlm_sft
from .watchdog import HangWatchdog

__all__ = ["TrainResult", "build_mesh_context", "mesh_arguments", "model_inputs", "run", "train_step"]

logger = logging.getLogger("automodel.training")


@dataclass
class TrainResult:
    """What a run did: the loss of every step it trained (resumed steps included from the checkpoint), the
    validation losses by step, the last checkpoint it wrote, and the signal that ended it early, if any."""

    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0
    export_dir: str | None = None
    model: nn.Module | None = None
    eval_losses: dict[int, float] = field(default_factory=dict)
    learning_rates: list[float] = field(default_factory=list)  # of the steps this run trained
    checkpoint: Path | None = None
    preempted: str | None = None  # the signal's name


@dataclass(frozen=True)
class Throughput:
    """Tokens per second (padding excluded) and the MFU estimate (``None`` without ``train.peak_tflops``)."""

    tokens_per_s: float
    mfu: float | None


def _build_model(config: RecipeConfig, context: MeshContext, kind: str) -> nn.Module:
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
    auto_class = NeMoAutoModelForImageTextToText if kind == IMAGE_TEXT_TO_TEXT else NeMoAutoModelForCausalLM
    return auto_class.from_pretrained(
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


def _tokenize_sft(path: str, tokenizer, seq_len: int, **hub: Any) -> list:
    """Chat records tokenized by a tokenizer's template, or (a processor) rendered with their images. ``hub``: the
    split and configuration name of a hub dataset id."""
    if hasattr(tokenizer, "image_processor"):
        return tokenize_vlm_sft(resolve_image_paths(load_records(path, kind="vlm", **hub), path), tokenizer, seq_len)
    return tokenize_sft(load_records(path, kind="sft", **hub), tokenizer, seq_len)


def _pad_id(tokenizer) -> int:
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own tokenizer
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _build_loader(config: RecipeConfig, tokenizer, context: MeshContext) -> DistributedBatchLoader | PrefetchingLoader:
    """The run's batches: prepared data (``data.path`` a prepared folder, or ``data.blend``) read window by window
    with a background prefetch, else the data tokenized in memory."""
    train, data = config.train, config.data
    pad_id = _pad_id(tokenizer)
    prepared = read_prepared(config, tokenizer, pad_id)
    if prepared is not None:
        examples, shuffle = prepared
    elif config.recipe == "pretrain":
        texts = load_texts(data.path, split=data.split, name=data.name)
        examples, shuffle = tokenize_pretraining(texts, tokenizer, train.seq_len), True
    else:
        examples, shuffle = _tokenize_sft(data.path, tokenizer, train.seq_len, split=data.split, name=data.name), True
        if data.packing:
            examples = pack_examples(examples, train.seq_len, pad_id)
    if prepared is None:
        suggest_prepare_data(config, examples)
    loader = DistributedBatchLoader(
        examples,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp_rank=context.mesh("dp").get_local_rank(),
        dp_size=context.dp_size,
        seq_len=train.seq_len,
        pad_id=pad_id,
        seed=data.seed,
        shuffle=shuffle,
    )
    return loader if prepared is None else PrefetchingLoader(loader)


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
    """Train as ``config`` says; resume from the newest complete checkpoint in ``checkpoint.dir`` if there is one.

    A SIGTERM or SIGUSR1 (to any rank, or forwarded by the ``automodel`` command or torchrun) ends the run after the
    current step with a complete checkpoint (``result.preempted``); a second one stops at once."""
    with PreemptionHandler() as preemption:
        return _run(config, preemption)


def _run(config: RecipeConfig, preemption: PreemptionHandler) -> TrainResult:
    train = config.train
    context = build_mesh_context(config)
    prepare_model(config)
    torch.manual_seed(train.seed)
    kind = _model_kind(config)
    tokenizer = _tokenizer_or_processor(config, kind)
    model = _build_model(config, context, kind)
    model.train()
    if config.data.packing and config.recipe == "sft":
        check_packed_attention(model, context, tolerance=_packing_tolerance(config))
    loader = _build_loader(config, tokenizer, context)
    validation = _validation_set(config, tokenizer)
    optimizer = make_optimizer(model, train)
    scheduler = make_scheduler(optimizer, train)
    megatron = "the fused loss runs with fsdp2 or ddp" if config.layout.strategy == "megatron_fsdp" else None
    loss_fn, loss_line = choose_loss(train.loss, train.loss_chunk_size, model, fused_refusal=megatron)
    log_rank_zero(logger, "%s", loss_line)
    _log_grad_sync(config, loader.grad_accumulation_steps)
    result = TrainResult()
    base = frozen_base_identity(config, model)  # read again from model.path on resume: its identity is checked
    resumed = resume_if_saved(config, model, optimizer, scheduler, loader, base)
    if resumed is not None:
        result.losses, result.resumed_from = list(resumed.losses), resumed.step
    trackers = Trackers(config, rank=dist.get_rank())
    device = next(model.parameters()).device
    flops = flops_per_token(_whole_model(model), train.seq_len)
    if isinstance(model, PipelinedModel):
        layout = model.layout
        log_rank_zero(
            logger,
            "pipeline: %s over %d stages (%d per rank), %d microbatches per step; ideal bubble %.1f%%",
            layout.schedule,
            layout.num_stages,
            layout.virtual_stages,
            layout.microbatches,
            100 * layout.ideal_bubble(),
        )
    is_main = dist.get_rank() == 0
    last = train.max_steps
    if train.stop_after_steps is not None:
        last = min(last, result.resumed_from + train.stop_after_steps)
    checkpoint = config.checkpoint
    checkpointer = None
    if checkpoint.dir is not None:
        checkpointer = Checkpointer(checkpoint.dir, keep=checkpoint.keep, asynchronous=checkpoint.async_)
    # A bar on a terminal only, with the log lines written above it; in a log file, only whole step lines (a bar's
    # carriage-return redraws would glue onto them).
    bar = tqdm(
        range(result.resumed_from, last), desc=config.recipe, disable=progress_bars_disabled() if is_main else True
    )
    with HangWatchdog(train.hang_timeout_s, rank=dist.get_rank()) as watchdog, logging_redirect_tqdm():
        for step in bar:
            start = time.perf_counter()
            micro_batches = loader.next_global_batch()
            loss = train_step(model, micro_batches, context, loss_fn, grad_sync=train.grad_sync)
            norm = clip_grad_norm(model.parameters(), train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            tokens, stop = _step_facts(micro_batches, preemption, context, device)
            seconds = time.perf_counter() - start
            result.losses.append(loss.item())
            _check_finite(step + 1, result.losses[-1], norm)
            result.learning_rates.append(lr)
            throughput = Throughput(
                tokens / seconds,
                model_flops_utilization(tokens / seconds, flops, train.peak_tflops, dist.get_world_size()),
            )
            bubble = model.last_bubble if isinstance(model, PipelinedModel) else None
            _log(
                step + 1,
                result.losses[-1],
                lr,
                norm.item(),
                throughput,
                seconds,
                bar,
                trackers,
                train.log_every,
                bubble,
            )
            watchdog.beat(step + 1)
            if is_main:
                record_progress(step + 1)  # for the command's line on a restart
            if checkpointer is not None and (_should_save(config, step + 1, last) or stop):
                state = trainer_state(config, step + 1, scheduler, loader, result.losses, base)
                checkpointer.save(model, optimizer, state)  # in the background with checkpoint.async
            if validation is not None and (stop or _should_evaluate(train, step + 1, last)):
                result.eval_losses[step + 1] = _evaluate(validation, model, context, step + 1, trackers)
            if stop:
                result.preempted = stop
                if checkpointer is not None:
                    result.checkpoint = checkpointer.wait()
                _log_preemption(result, step + 1)
                break
    if checkpointer is not None:
        result.checkpoint = checkpointer.wait()  # the save in flight, if any, completes and is committed
    trackers.close()
    if isinstance(loader, PrefetchingLoader):
        loader.close()
    result.model = model
    if config.export.dir is not None and last == train.max_steps and result.preempted is None:
        result.export_dir = str(export_trained(config, model, tokenizer))
    return result


def _whole_model(model: nn.Module) -> nn.Module:
    """The whole transformers model (on meta under PP: every stage's parameters, for the FLOP count)."""
    return model.whole_on_meta if isinstance(model, PipelinedModel) else transformers_model(model)


def _model_kind(config: RecipeConfig) -> str:
    """The auto class the run uses (``model.kind``, or what the checkpoint is); refuses what a vision-language run
    cannot do."""
    model = config.model
    kind = model_kind(model.path, model.kind, revision=model.revision, trust_remote_code=model.trust_remote_code)
    if kind == IMAGE_TEXT_TO_TEXT:
        try:
            validate_vision_language(config)
        except ConfigError as error:
            raise ValueError(f"{model.path} is a vision-language model: {error}") from error
        log_rank_zero(logger, "%s is a vision-language model: chats are rendered by its processor", model.path)
    return kind


def _tokenizer_or_processor(config: RecipeConfig, kind: str):
    """The model's processor (vision-language: its chat template renders images too; exported with the model), else
    its tokenizer."""
    model = config.model
    if kind == IMAGE_TEXT_TO_TEXT:
        return AutoProcessor.from_pretrained(
            model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    return AutoTokenizer.from_pretrained(model.path, revision=model.revision)


def _step_facts(
    micro_batches: list[dict[str, torch.Tensor]], preemption: PreemptionHandler, context: MeshContext, device
) -> tuple[int, str | None]:
    """Collective, one all-reduce: the step's tokens without padding over all data-parallel ranks, and the name of
    the preemption signal any rank got (``None``: none did)."""
    replicas = dist.get_world_size() / context.dp_size  # ranks holding the same batch (TP, CP)
    mine = sum(int(batch["num_tokens"]) for batch in micro_batches)
    signum = 0 if preemption.received is None else int(preemption.received)
    facts = torch.tensor([mine / replicas, signum, 1.0 if signum else 0.0], dtype=torch.float64).to(device)
    dist.all_reduce(facts)
    tokens, signums, receivers = round(facts[0].item()), facts[1].item(), facts[2].item()
    if not receivers:
        return tokens, None
    try:
        return tokens, signal.Signals(round(signums / receivers)).name  # the signal the receiving ranks got
    except ValueError:  # different signals on different ranks
        return tokens, "a preemption signal"


def _log_grad_sync(config: RecipeConfig, accumulation_steps: int) -> None:
    """With FSDP2 and gradient accumulation: when the step reduces its gradients (``train.grad_sync``)."""
    if config.layout.strategy != "fsdp2" or config.layout.pp_size > 1 or accumulation_steps < 2:
        return
    when = {
        "step": "once per step, after the last (unsharded gradients held through the accumulation)",
        "micro_batch": "after every micro batch (sharded gradients only)",
    }[config.train.grad_sync]
    log_rank_zero(
        logger,
        "gradient accumulation: %d micro batches per rank per step; gradients reduced %s (train.grad_sync: %s)",
        accumulation_steps,
        when,
        config.train.grad_sync,
    )


def _log_preemption(result: TrainResult, step: int) -> None:
    if result.checkpoint is not None:
        log_rank_zero(
            logger,
            "%s: stopped after step %d with checkpoint %s; run the same command to resume.",
            result.preempted,
            step,
            result.checkpoint,
        )
    else:
        log_rank_zero(
            logger, "%s: stopped after step %d without a checkpoint (no checkpoint.dir).", result.preempted, step
        )


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


def _check_finite(step: int, loss: float, norm: torch.Tensor) -> None:
    """Stop a run whose loss is not a number before it checkpoints or exports it: the loss is reduced over the ranks,
    so every rank stops at the same step."""
    if math.isfinite(loss):
        return
    raise FloatingPointError(
        f"step {step}: the loss is {loss} (gradient norm {norm.item():.4g}): training diverged, so the run stops "
        "before a checkpoint or an export holds these weights. Lower train.lr, set train.max_grad_norm, or look for "
        "a batch with extreme values."
    )


def _log(step, loss, lr, norm, throughput: Throughput, seconds, bar, trackers: Trackers, every, bubble=None) -> None:
    if dist.get_rank() != 0 or step % every:
        return
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
    mfu = f" | MFU {throughput.mfu:.1%}" if throughput.mfu is not None else ""
    idle = f" | bubble {bubble:.1%}" if bubble is not None else ""
    logger.info(
        "step %d | loss %.4f | lr %.3e | grad norm %.3f | %.0f tokens/s%s%s | %.2f s",
        step,
        loss,
        lr,
        norm,
        throughput.tokens_per_s,
        mfu,
        idle,
        seconds,
    )
    scalars = {"loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": throughput.tokens_per_s}
    if throughput.mfu is not None:
        scalars["mfu"] = throughput.mfu
    if bubble is not None:
        scalars["pipeline_bubble"] = bubble
    trackers.scalars({f"train/{name}": value for name, value in scalars.items()}, step)


def _should_evaluate(train, step: int, last: int) -> bool:
    return step == last or (train.eval_every_steps > 0 and step % train.eval_every_steps == 0)


def _evaluate(
    validation: ValidationSet, model: nn.Module, context: MeshContext, step: int, trackers: Trackers
) -> float:
    loss = validation.loss(model, context, model_inputs)
    log_rank_zero(logger, "step %d | eval loss %.4f", step, loss)
    trackers.scalars({"eval/loss": loss}, step)
    return loss


def _validation_set(config: RecipeConfig, tokenizer) -> ValidationSet | None:
    data, train = config.data, config.train
    if data.validation_path is None:
        return None
    pad_id = _pad_id(tokenizer)
    if is_prepared(data.validation_path):  # held-out data is small: its examples are read once, into memory
        examples = list(PreparedExamples(PreparedCorpus(data.validation_path), train.seq_len, pad_id=pad_id))
    elif config.recipe == "pretrain":
        texts = load_texts(data.validation_path, split="validation", name=data.name)
        examples = tokenize_pretraining(texts, tokenizer, train.seq_len)
    else:
        examples = _tokenize_sft(data.validation_path, tokenizer, train.seq_len, split="validation", name=data.name)
    return ValidationSet(examples, micro_batch_size=train.micro_batch_size, seq_len=train.seq_len, pad_id=pad_id)
