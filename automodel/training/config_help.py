"""What ``automodel sft --help`` and ``automodel pretrain --help`` list: the recipe's own config keys, each with its
default and a one-line meaning (docs/recipes.md has the long form)."""

from __future__ import annotations

import dataclasses
import typing

from .config import RecipeConfig

__all__ = ["KEY_MEANINGS", "config_keys", "describe_keys"]

#: One line per config key; ``tests/test_training_config.py`` checks that every key has one and no other key does.
KEY_MEANINGS = {
    "model.path": "hub id or local folder: the checkpoint (sft), or the config and tokenizer source (pretrain)",
    "model.kind": "auto (from the checkpoint's config), causal_lm, or image_text_to_text (a vision-language model)",
    "model.dtype": "float32 or bfloat16: the dtype the weights are loaded in",
    "model.revision": "hub revision (branch, tag or commit)",
    "model.trust_remote_code": "allow the checkpoint's own modeling code",
    "model.attn_implementation": "attention kernel, e.g. sdpa or eager (null: transformers' default)",
    "model.tiny_if_missing": "the project's smoke tests: write a tiny RANDOM Llama to model.path if nothing is there",
    "layout.strategy": "fsdp2, ddp or megatron_fsdp (CUDA)",
    "layout.dp_replicate_size": "HSDP: replicas of the sharded model (dp_shard is what is left of the processes)",
    "layout.tp_size": "tensor parallelism: ranks that split each layer (must divide the attention heads)",
    "layout.cp_size": "context parallelism: ranks that split each sequence",
    "layout.ep_size": "expert parallelism: ranks that split the routed experts (MoE models)",
    "layout.sequence_parallel": "with TP: norms and dropout on sequence shards",
    "layout.activation_checkpointing": "false, true / full, or selective: recompute activations in the backward",
    "layout.mixed_precision": "fp32, or bf16: FSDP2 computes in bf16 and reduces gradients in fp32",
    "layout.compile": "torch.compile each decoder block: auto (on CUDA, eager on CPU), true or false",
    "layout.reshard_after_forward": "FSDP2: default / all_but_last (not the last layer, the head), always (ZeRO-3) or never (ZeRO-2)",
    "layout.prefetch": "FSDP2: start the next layer's all-gather before a layer computes (forward and backward)",
    "layout.pp_size": "pipeline parallelism: stage groups of ranks (the outermost axis)",
    "layout.pp_schedule": "gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble or zbv",
    "layout.pp_virtual_stages": "pipeline stages per rank (the interleaved schedules and zbv)",
    "data.path": "the training data: JSONL or text files, a folder, a local or hub dataset, or a prepared folder",
    "data.packing": "pack several examples into each sequence, each attending only to itself",
    "data.seed": "the shuffling seed (each epoch reshuffles deterministically)",
    "data.validation_path": "held-out data in data.path's format, evaluated as eval loss",
    "data.blend": "pretraining: prepared folders mixed at weights, [{path: A, weight: 0.7}, ...] (instead of path)",
    "data.split": "the split to train on: of a hub dataset id (org/name), or of a local dataset with several",
    "data.name": "with a hub dataset id as data.path: the dataset's configuration name",
    "data.allow_tokenizer_mismatch": "train on prepared data whose manifest names another tokenizer than the model's",
    "train.max_steps": "optimizer steps; the learning-rate schedule ends here",
    "train.global_batch_size": "sequences per optimizer step over all data-parallel ranks",
    "train.micro_batch_size": "sequences per forward (accumulation steps = global / (micro x dp))",
    "train.seq_len": "tokens per sequence (longer examples are truncated, shorter ones padded)",
    "train.lr": "peak learning rate (AdamW)",
    "train.min_lr": "final learning rate of the cosine decay",
    "train.warmup_steps": "linear warmup steps before the cosine decay",
    "train.weight_decay": "AdamW weight decay (not on norms and biases)",
    "train.betas": "AdamW betas",
    "train.max_grad_norm": "clip the global gradient norm to this (null: only measure it)",
    "train.seed": "torch seed, and the initialisation seed of pretraining",
    "train.log_every": "log a step line every this many steps",
    "train.tensorboard_dir": "write the training scalars to TensorBoard there",
    "train.stop_after_steps": "end this run after this many steps, with a checkpoint; the next run resumes",
    "train.eval_every_steps": "with data.validation_path: evaluate every this many steps (0: at the end)",
    "train.peak_tflops": "one device's peak TFLOP/s: the step line then shows MFU",
    "train.loss": "auto (fused where exact, else model), model (the model's own loss), fused (chunked: its old name)",
    "train.loss_chunk_size": "tokens per chunk of train.loss=fused",
    "train.grad_sync": "FSDP2 gradient reduction: step (after the last micro batch) or micro_batch (less memory)",
    "train.pp_microbatches": "with layout.pp_size > 1: microbatches per step (null: the accumulation steps)",
    "train.hang_timeout_s": "end a run whose step has not completed in this many seconds, with stacks (0: off)",
    "lora.rank": "LoRA adapter rank (0: train the whole model)",
    "lora.alpha": "LoRA scaling numerator",
    "lora.dropout": "LoRA dropout",
    "lora.target_modules": "module names the adapters wrap (all-linear: every linear layer but the head)",
    "checkpoint.dir": "where step checkpoints go; a run resumes from the newest complete one there",
    "checkpoint.every_steps": "checkpoint period in steps (0: only at the end)",
    "checkpoint.keep": "complete checkpoints kept",
    "checkpoint.async": "write checkpoints in the background while training goes on",
    "export.dir": "write the trained model there as a Hugging Face checkpoint with a model card",
    "export.max_shard_size": "size of the exported safetensors files",
    "export.push_to_hub": "a hub repo id to upload the export to",
    "export.lora": "with LoRA: merged (a full checkpoint), adapter (peft's files) or both",
    "log.dir": "the folder of the run's log files (every rank's output and tracebacks)",
    "log.wandb.project": "log the training scalars to this Weights & Biases project",
    "log.wandb.name": "the W&B run name",
    "log.wandb.mode": "online, offline (synced later with `wandb sync`) or disabled",
    "log.wandb.dir": "the folder of W&B's local files (default: the current directory)",
    "log.mlflow.experiment": "log the training scalars and the config to this MLflow experiment",
    "log.mlflow.tracking_uri": "the MLflow server or store (default: MLflow's own, MLFLOW_TRACKING_URI)",
    "log.mlflow.run_name": "the MLflow run name",
}

#: Keys that mean something to the SFT recipe only.
_SFT_ONLY = ("model.kind", "data.packing", "lora.", "export.lora")


def config_keys(section: type = RecipeConfig, prefix: str = "") -> dict[str, object]:
    """Every config key (dotted, nested sections included) with its default."""
    keys: dict[str, object] = {}
    defaults, hints = section(), typing.get_type_hints(section)
    for item in dataclasses.fields(section):
        name, hint = item.metadata.get("key", item.name), hints[item.name]
        if dataclasses.is_dataclass(hint):
            keys.update(config_keys(hint, f"{prefix}{name}."))
        elif prefix:
            keys[f"{prefix}{name}"] = getattr(defaults, item.name)
    return keys


def describe_keys(recipe: str | None = None) -> str:
    """The config keys of ``recipe`` (every key without one), a line each: ``key = default   meaning``."""
    keys = {
        key: default for key, default in config_keys().items() if recipe != "pretrain" or not key.startswith(_SFT_ONLY)
    }
    shown = {key: "(required)" if key in ("model.path", "data.path") else _yaml(value) for key, value in keys.items()}
    width = max(len(f"{key} = {value}") for key, value in shown.items())
    title = f"config keys of `automodel {recipe}`" if recipe else "config keys"
    lines = [f"{title} (key = default, then its meaning; docs/recipes.md has more):"]
    for key, value in shown.items():
        lines.append(f"  {f'{key} = {value}':<{width}}  {KEY_MEANINGS[key]}")
    return "\n".join(lines)


def _yaml(value: object) -> str:
    """A default as it is written in a config file or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(_yaml, value)) + "]"
    return str(value)
