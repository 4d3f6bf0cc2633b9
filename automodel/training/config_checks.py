"""The recipe config's checks that need more than one key, and those that need the number of processes (before
launching them): each names the keys and the fix."""

from __future__ import annotations

import importlib.util

from .config_errors import ConfigError
from .config_sections import LoraSection, RecipeConfig

__all__ = ["check_world_size", "pipeline_microbatches", "validate_config", "validate_vision_language"]


def check_world_size(config: RecipeConfig, world_size: int) -> None:
    """The layout and batch checks that need the number of processes (before launching them): the errors name the
    ``layout.*`` / ``train.*`` keys and the process count."""
    from automodel.distributed.layout import check_layout

    layout, train = config.layout, config.train
    if layout.pp_size > 1 and world_size % layout.pp_size:
        raise ConfigError(f"layout.pp_size={layout.pp_size} does not divide the {world_size} processes.")
    try:
        sizes = check_layout(
            layout.strategy,
            world_size // layout.pp_size,
            dp_replicate_size=layout.dp_replicate_size,
            tp_size=layout.tp_size,
            cp_size=layout.cp_size,
            ep_size=layout.ep_size,
            sequence_parallel=layout.sequence_parallel,
        )
    except (ValueError, RuntimeError) as error:
        raise ConfigError(f"layout does not fit {world_size} processes: {error}") from error
    per_step = train.micro_batch_size * sizes["dp"]
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of train.micro_batch_size * the "
            f"data-parallel size = {train.micro_batch_size} * {sizes['dp']} on {world_size} processes."
        )
    if layout.pp_size > 1:
        pipeline_microbatches(config, world_size)


def pipeline_microbatches(config: RecipeConfig, world_size: int) -> int:
    """The microbatches a pipelined step runs (``train.pp_microbatches``, by default the gradient accumulation
    steps), checked against the pipeline and this rank's share of the global batch."""
    from automodel.distributed.layout import Layout

    layout, train = config.layout, config.train
    sizes = dict(
        pp_size=layout.pp_size,
        dp_replicate_size=layout.dp_replicate_size,
        tp_size=layout.tp_size,
        cp_size=layout.cp_size,
        ep_size=layout.ep_size,
        sequence_parallel=layout.sequence_parallel,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
    )
    dp = Layout(layout.strategy, world_size, **sizes).validate(pipeline=False).dp
    rows = train.global_batch_size // dp
    microbatches = train.pp_microbatches or rows // train.micro_batch_size
    try:
        Layout(layout.strategy, world_size, **sizes, pp_microbatches=microbatches).validate()
    except ValueError as error:
        source = "train.pp_microbatches" if train.pp_microbatches else "the gradient accumulation steps"
        raise ConfigError(
            f"layout.pp_size={layout.pp_size} ({source}: {microbatches} microbatches): {error}"
        ) from error
    if rows % microbatches:
        raise ConfigError(
            f"train.pp_microbatches={microbatches} must divide each data-parallel rank's share of the global batch, "
            f"train.global_batch_size / dp = {train.global_batch_size} / {dp} = {rows} rows."
        )
    return microbatches


def validate_config(config: RecipeConfig) -> None:
    """Checks that need more than one key (each names the keys and the fix)."""
    train, model = config.train, config.model
    if not model.path:
        raise ConfigError("model.path is required: a hub id or a local checkpoint directory.")
    _validate_data(config)
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "seq_len", "loss_chunk_size", "log_every"):
        if getattr(train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(train, key)} must be at least 1.")
    if train.seq_len < 2:  # a causal LM's loss needs a next token
        raise ConfigError(
            f"train.seq_len={train.seq_len} leaves no token to predict (each token's target is the next one): use 2 "
            "or more."
        )
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={train.micro_batch_size} (times the data-parallel size)."
        )
    if train.lr <= 0 or train.min_lr < 0 or train.min_lr > train.lr:
        raise ConfigError(f"train.lr={train.lr} must be > 0 and train.min_lr={train.min_lr} in [0, lr].")
    if train.weight_decay < 0:
        raise ConfigError(f"train.weight_decay={train.weight_decay} must be >= 0 (0: no decay).")
    if not all(0 <= beta < 1 for beta in train.betas):
        raise ConfigError(f"train.betas={list(train.betas)}: each of AdamW's two betas must be in [0, 1).")
    if not 0 <= train.warmup_steps <= train.max_steps:
        raise ConfigError(f"train.warmup_steps={train.warmup_steps} must be in [0, train.max_steps].")
    if train.max_grad_norm is not None and train.max_grad_norm <= 0:
        raise ConfigError(f"train.max_grad_norm={train.max_grad_norm} must be > 0, or null to disable clipping.")
    if train.stop_after_steps is not None and (train.stop_after_steps < 1 or config.checkpoint.dir is None):
        raise ConfigError("train.stop_after_steps needs a value >= 1 and checkpoint.dir (the run resumes from it).")
    if train.eval_every_steps < 0:
        raise ConfigError(f"train.eval_every_steps={train.eval_every_steps} must be >= 0 (0: only at the end).")
    if train.eval_every_steps and config.data.validation_path is None:
        raise ConfigError("train.eval_every_steps is set but data.validation_path is not: say what to evaluate on.")
    if train.peak_tflops is not None and train.peak_tflops <= 0:
        raise ConfigError(f"train.peak_tflops={train.peak_tflops} must be > 0 (one device's peak), or null.")
    trackers = (
        ("train.tensorboard_dir", train.tensorboard_dir, "tensorboard", "tensorboard"),
        ("log.wandb.project", config.log.wandb.project, "wandb", '"automodel[wandb]"'),
        ("log.mlflow.experiment", config.log.mlflow.experiment, "mlflow", '"automodel[mlflow]"'),
    )
    for key, value, module, requirement in trackers:
        if value is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}={value} needs the {module} package: pip install {requirement}.")
    if config.layout.compile is True and (config.layout.ep_size > 1 or config.layout.strategy == "megatron_fsdp"):
        raise ConfigError(
            "layout.compile=true compiles decoder blocks with layout.strategy=fsdp2 or ddp and ep_size=1 (the expert "
            "all-to-all breaks a block's graph at every exchange; Megatron-FSDP swaps its buffers in outside it)."
        )
    if train.pp_microbatches is not None and train.pp_microbatches < 1:
        raise ConfigError(f"train.pp_microbatches={train.pp_microbatches} must be at least 1 (or null).")
    if train.pp_microbatches is not None and config.layout.pp_size == 1:
        raise ConfigError("train.pp_microbatches is set but layout.pp_size is 1: it applies to pipeline parallelism.")
    if train.grad_sync == "micro_batch" and (config.layout.strategy == "megatron_fsdp" or config.layout.pp_size > 1):
        raise ConfigError(
            "train.grad_sync=micro_batch runs with layout.strategy=fsdp2 or ddp and layout.pp_size=1: Megatron-FSDP "
            "and the pipeline schedule choose when gradients are reduced themselves. Use train.grad_sync=step."
        )
    if train.loss in ("fused", "chunked") and config.layout.strategy == "megatron_fsdp":
        raise ConfigError(f"train.loss={train.loss} runs with layout.strategy=fsdp2 or ddp, not megatron_fsdp.")
    if model.kind == "image_text_to_text":
        validate_vision_language(config)
    _validate_lora(config)
    if config.train.hang_timeout_s < 0:
        raise ConfigError(f"train.hang_timeout_s={config.train.hang_timeout_s} must be 0 (no watchdog) or more.")
    if config.checkpoint.every_steps < 0 or config.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every_steps must be >= 0 and checkpoint.keep >= 1.")
    if config.checkpoint.every_steps and config.checkpoint.dir is None:
        raise ConfigError("checkpoint.every_steps is set but checkpoint.dir is not: say where checkpoints go.")
    if config.export.push_to_hub and config.export.dir is None:
        raise ConfigError("export.push_to_hub needs export.dir (the folder that is uploaded).")


def _validate_data(config: RecipeConfig) -> None:
    data = config.data
    if data.blend:
        if data.path:
            raise ConfigError("data.path and data.blend are both set: give one (data.blend lists the sources itself).")
        if config.recipe != "pretrain":
            raise ConfigError("data.blend mixes pretraining sources: use it with `automodel pretrain`.")
        for index, source in enumerate(data.blend):
            if not source.path or source.weight <= 0:
                raise ConfigError(f"data.blend[{index}] needs a path and a weight > 0, got {source}.")
        return
    if not data.path:
        raise ConfigError(
            "data.path is required: a JSONL file, a folder of them, a local dataset, or a prepared folder (or give "
            "data.blend)."
        )


def validate_vision_language(config: RecipeConfig) -> None:
    """What a vision-language run refuses (also checked at run time, when ``model.kind: auto`` finds one)."""
    if config.recipe == "pretrain":
        raise ConfigError(
            "model.kind=image_text_to_text: the pretrain recipe trains text models only; use recipe: sft."
        )
    if config.data.packing:
        raise ConfigError(
            "data.packing=true is not supported for vision-language models: packed chats would need their image "
            "tensors and multimodal positions packed with them. Set data.packing=false."
        )


def _validate_lora(config: RecipeConfig) -> None:
    lora, layout = config.lora, config.layout
    if lora.rank < 0 or lora.rank == 0 and lora != LoraSection():
        raise ConfigError(
            f"lora.rank={lora.rank}: set a positive rank to train LoRA adapters (0 trains the whole model)."
        )
    if lora.rank == 0:
        if config.export.lora != "merged":
            raise ConfigError(f"export.lora={config.export.lora!r} needs LoRA adapters: set lora.rank > 0.")
        return
    if config.recipe != "sft":
        raise ConfigError("lora.rank > 0 adapts a pretrained model: use it with `automodel sft`, not pretraining.")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout={lora.dropout} must be in [0, 1) (the probability of dropping an input).")
    if layout.strategy == "megatron_fsdp":
        raise ConfigError("LoRA runs with layout.strategy=fsdp2 or ddp, not megatron_fsdp.")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError('lora.rank > 0 needs the peft package: pip install "automodel[peft]".')
