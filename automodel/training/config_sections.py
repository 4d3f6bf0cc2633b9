"""The recipe config's sections: typed, frozen dataclasses, one per YAML section (``automodel.training.config``
parses and checks them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "RECIPES",
    "RESHARD_POLICIES",
    "BlendSource",
    "CheckpointSection",
    "DataSection",
    "ExportSection",
    "LayoutSection",
    "LogSection",
    "LoraSection",
    "MlflowSection",
    "ModelSection",
    "RecipeConfig",
    "TrainSection",
    "WandbSection",
    "config_key",
]

RECIPES = ("sft", "pretrain")


@dataclass(frozen=True)
class ModelSection:
    """``path``: a hub id or local directory (checkpoint for SFT; config + tokenizer source for pretraining).
    ``tiny_if_missing``: when ``path`` does not exist, write a tiny random Llama there (the project's smoke tests,
    ``recipes/sft_tiny.yaml``; never in a user's config, where a mistyped path would train random weights). ``kind``: the auto class;
    ``auto`` reads the checkpoint's config (a vision-language model takes ``image_text_to_text``, which renders its
    chats with the model's processor; see ``docs/vlm.md``)."""

    path: str = ""
    kind: Literal["auto", "causal_lm", "image_text_to_text"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    tiny_if_missing: bool = False


#: ``layout.reshard_after_forward`` -> ``FSDP2Config.reshard_after_forward``.
RESHARD_POLICIES: dict[str, bool | None] = {"default": None, "all_but_last": None, "always": True, "never": False}


@dataclass(frozen=True)
class LayoutSection:
    """The ``MeshContext.build`` arguments; ``mixed_precision: bf16`` computes in bf16 with fp32 gradient reduction."""

    strategy: Literal["fsdp2", "ddp", "megatron_fsdp"] = "fsdp2"
    dp_replicate_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: Literal[False, True, "full", "selective"] = False
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    # FSDP2: which units free their unsharded parameters after forward: default / all_but_last (torchtitan's "default":
    # all but the last decoder layer and the head), always (ZeRO-3) or never (ZeRO-2); prefetch: the next layer's
    # all-gather starts before a layer computes.
    reshard_after_forward: Literal["default", "all_but_last", "always", "never"] = "default"
    prefetch: bool = True
    # torch.compile each decoder block (after TP and activation checkpointing, before FSDP2): auto compiles on CUDA
    # and runs eagerly on CPU and where blocks cannot compile (EP, Megatron-FSDP); true / false force it.
    compile: Literal[False, True, "auto"] = "auto"
    # Pipeline parallelism: pp_size stage groups (the outermost axis), each running its stages with the axes above;
    # the schedule runs train.pp_microbatches microbatches per step (docs/parallelisms.md, "Pipeline parallelism").
    pp_size: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"] = "1f1b"
    pp_virtual_stages: int = 1


@dataclass(frozen=True)
class BlendSource:
    """One source of ``data.blend``: a prepared folder and its weight (the weights need not sum to 1)."""

    path: str = ""
    weight: float = 1.0


@dataclass(frozen=True)
class DataSection:
    """``path``: chat / prompt-completion JSONL (SFT), text files or ``{"text"}`` JSONL (pretraining), any local
    dataset ``datasets`` reads, or a folder ``automodel prepare-data`` wrote. ``blend``: prepared folders mixed at
    their weights (pretraining; instead of ``path``)."""

    path: str = ""
    packing: bool = False
    seed: int = 0
    # Held-out data in the same format, evaluated every train.eval_every_steps and at the end (eval loss in the log).
    validation_path: str | None = None
    blend: tuple[BlendSource, ...] = ()
    # The split to train on (of a hub dataset id, org/name; of a local dataset with several, by file name or saved
    # splits) and a hub dataset's configuration name.
    split: str = "train"
    name: str | None = None
    # Train on prepared data whose tokenizer is not the model's (its manifest names another): only if you know why.
    allow_tokenizer_mismatch: bool = False


@dataclass(frozen=True)
class TrainSection:
    """Schedule: AdamW, linear warmup then cosine decay to ``min_lr``, gradient accumulation to the global batch."""

    max_steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_len: int = 512
    lr: float = 1e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float | None = 1.0
    seed: int = 0
    log_every: int = 1
    tensorboard_dir: str | None = None
    # End this run after this many steps (with a checkpoint), e.g. to fit a job's time limit; the schedule still
    # runs to max_steps, and the next run resumes there.
    stop_after_steps: int | None = None
    # With data.validation_path: evaluate every this many steps (0: only at the end of the run).
    eval_every_steps: int = 0
    # Peak dense TFLOP/s of one device (e.g. 989 for an H100 in bf16): the log then shows MFU.
    peak_tflops: float | None = None
    # "fused": the head and cross-entropy over chunks of loss_chunk_size tokens, each chunk's gradients computed in
    # the forward, never the full logits ("chunked": its deprecated name, accepted with a warning for one release);
    # "auto": fused wherever it is exact for the model (measured faster), else "model".
    loss: Literal["auto", "model", "fused", "chunked"] = "auto"
    loss_chunk_size: int = 4096
    # With gradient accumulation under FSDP2: "step" reduces the gradients once, after the last micro batch (half the
    # collectives; a rank holds its units' unsharded gradients through the accumulation, up to the whole model's);
    # "micro_batch" reduces after every micro batch (the sharded gradients only; one reduction per micro batch).
    grad_sync: Literal["step", "micro_batch"] = "step"
    # With layout.pp_size > 1: the microbatches the pipeline schedule runs per step (each rank's share of the global
    # batch split into equal parts; null: one per train.micro_batch_size rows, the gradient accumulation steps).
    pp_microbatches: int | None = None
    # A hung run ends: if no step completes within this many seconds, every rank dumps its stacks, says where it
    # waits, and exits with status 124 (0: no watchdog).
    hang_timeout_s: float = 1800.0


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters through ``peft`` (SFT on the FSDP2 path); ``rank: 0`` trains the whole model."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")


@dataclass(frozen=True)
class CheckpointSection:
    """``dir``: where step checkpoints go (resumed from automatically); ``every_steps``: 0 saves only at the end;
    ``async`` (``async_`` here: a Python keyword): write them in the background while training goes on."""

    dir: str | None = None
    every_steps: int = 0
    keep: int = 2
    async_: bool = dataclasses.field(default=False, metadata={"key": "async"})


@dataclass(frozen=True)
class ExportSection:
    """``dir``: the consolidated HF checkpoint written after training; ``push_to_hub``: a repo id to upload it to.
    ``lora`` (with LoRA): ``merged`` folds the adapters into a full checkpoint in ``dir``, ``adapter`` writes only the
    adapter (peft's ``adapter_model.safetensors`` + ``adapter_config.json``) to ``dir``, ``both`` writes the merged
    checkpoint to ``dir`` and the adapter to ``dir/adapter``."""

    dir: str | None = None
    max_shard_size: str = "5GB"
    push_to_hub: str | None = None
    lora: Literal["merged", "adapter", "both"] = "merged"


@dataclass(frozen=True)
class WandbSection:
    """Weights & Biases (``pip install "automodel[wandb]"``): set ``project`` to log the training scalars there."""

    project: str | None = None
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    dir: str | None = None


@dataclass(frozen=True)
class MlflowSection:
    """MLflow (``pip install "automodel[mlflow]"``): set ``experiment`` to log the training scalars and the config
    there; ``tracking_uri`` defaults to MLflow's own (``MLFLOW_TRACKING_URI``)."""

    experiment: str | None = None
    tracking_uri: str | None = None
    run_name: str | None = None


@dataclass(frozen=True)
class LogSection:
    """``dir``: the folder of the run's log files (``<recipe>-<time>-<host>.log``: every rank's output, tracebacks and
    torchrun's report; ``automodel.training.run_log``); ``wandb`` and ``mlflow``: trackers beside TensorBoard."""

    dir: str = "automodel_logs"
    wandb: WandbSection = field(default_factory=WandbSection)
    mlflow: MlflowSection = field(default_factory=MlflowSection)


@dataclass(frozen=True)
class RecipeConfig:
    """One recipe run. Build it with :func:`load_config`."""

    recipe: Literal["sft", "pretrain"] = "sft"
    model: ModelSection = field(default_factory=ModelSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    export: ExportSection = field(default_factory=ExportSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested values under the config's keys (for logs, checkpoints and the model card; the YAML it
        dumps loads back)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {config_key(item): _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def config_key(item: dataclasses.Field) -> str:
    """The config key of a section's field: its name, or the one it is given where the name cannot be it."""
    return item.metadata.get("key", item.name)
