"""Recipe configuration: typed, frozen sections parsed from YAML once, at the recipe boundary.

A config file names the model, the layout (the ``MeshContext.build`` arguments), the data, the training schedule,
checkpointing and export. Command-line overrides use dotted keys (``train.lr=3e-4``). Unknown keys and bad values
are errors that name the key, raised before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .config_errors import ConfigError, located, unknown_keys_error, yaml_key_lines

__all__ = [
    "PATH_KEYS",
    "BlendSource",
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "ExportSection",
    "LayoutSection",
    "LogSection",
    "MlflowSection",
    "LoraSection",
    "ModelSection",
    "RecipeConfig",
    "TrainSection",
    "WandbSection",
    "check_world_size",
    "layout_from_overrides",
    "load_config",
    "parse_overrides",
    "validate_vision_language",
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
    # With a hub dataset id as data.path (org/name): the split to train on and the dataset's configuration name.
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
        return {_key(item): _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


# Keys holding local paths, resolved against the YAML file's folder when relative. ``model.path`` may also be a hub
# id: it is resolved only when it starts with "." or names something that exists there.
PATH_KEYS = (
    "data.path",
    "data.validation_path",
    "checkpoint.dir",
    "export.dir",
    "train.tensorboard_dir",
    "log.dir",
)
MODEL_PATH_KEY = "model.path"
# data.path and data.validation_path may be hub dataset ids (org/name), kept as written when nothing is there.
_DATA_KEYS = ("data.path", "data.validation_path")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w-]*/[\w-]+")


def load_config(path: str | Path | None, overrides: list[str] = (), *, recipe: str | None = None) -> RecipeConfig:
    """Read a YAML config, apply ``key=value`` overrides (dotted keys, values parsed as YAML) and validate it.

    Relative paths written in the YAML file (``PATH_KEYS``, and ``model.path`` when it is not a hub id), and the
    default ``log.dir``, are relative to the file's folder, so a config runs from any directory; paths given as
    overrides are relative to the current directory, as on any command line. An error about a key written in the
    file names the file and its line.
    """
    raw: dict[str, Any] = {}
    lines: dict[str, int] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {path} does not exist.")
        text = path.read_text()
        raw, lines = yaml.safe_load(text) or {}, yaml_key_lines(text)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections, not {type(raw).__name__}.")
        _resolve_paths(raw, path.resolve().parent)
    given = parse_overrides(overrides)
    for key, value in given.items():
        _set_dotted(raw, key, value)
    if recipe is not None:
        if raw.get("recipe", recipe) != recipe:
            raise ConfigError(f"The config says recipe: {raw['recipe']!r}, but the command is `automodel {recipe}`.")
        raw["recipe"] = recipe
    try:
        config = _build(RecipeConfig, raw, "")
    except ConfigError as error:
        raise located(error, path, lines, given) from None
    _validate(config)
    return config


def _resolve_paths(raw: dict[str, Any], folder: Path) -> None:
    if isinstance(log := raw.setdefault("log", {}), dict):
        log.setdefault("dir", LogSection.dir)  # a default path of the config is relative to its folder too
    data = raw.get("data")
    blend = data.get("blend") if isinstance(data, dict) else None
    for source in blend if isinstance(blend, list) else ():
        value = source.get("path") if isinstance(source, dict) else None
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            source["path"] = str((folder / value).resolve())
    for key in (*PATH_KEYS, MODEL_PATH_KEY):
        section, _, name = key.partition(".")
        node = raw.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        resolved = folder / value
        hub_key = key == MODEL_PATH_KEY or (key in _DATA_KEYS and _HUB_ID.fullmatch(value) and "." not in value)
        if hub_key and not (value.startswith(".") or resolved.exists()):
            continue  # a hub id (of a model, or of a dataset)
        node[name] = str(resolved.resolve())


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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.lr=3e-4", "data.packing=true"]`` -> ``{"train.lr": 0.0003, "data.packing": True}``."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override {item!r} is not `dotted.key=value` (e.g. train.lr=3e-4).")
        parsed[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return parsed


def layout_from_overrides(items: list[str]) -> LayoutSection:
    """A layout section from ``layout.KEY=VALUE`` items (``automodel plan``), checked as a config's is."""
    raw: dict[str, Any] = {}
    for key, value in parse_overrides(items).items():
        section, _, name = key.partition(".")
        if section != "layout" or not name or "." in name:
            raise ConfigError(f"{key}: only layout.KEY=VALUE overrides are taken here (e.g. layout.tp_size=8).")
        raw[name] = value
    return _build(LayoutSection, raw, "layout.")


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"Override {key}: {section} is not a section.")
    node[last] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking every key and value type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping, got {raw!r}.", key=prefix.rstrip(".") or None)
    hints = typing.get_type_hints(cls)
    names = {_key(f): f.name for f in dataclasses.fields(cls)}
    fields = set(names)
    if set(raw) - fields:
        raise unknown_keys_error(set(raw) - fields, fields, prefix)
    values = {}
    for key, value in raw.items():
        hint = hints[name := names[key]]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{key}.")
            continue
        try:
            values[name] = _coerce(value, hint, f"{prefix}{key}")
        except ConfigError as error:
            raise ConfigError(str(error), key=error.key or f"{prefix}{key}") from None
    return cls(**values)


def _key(item: dataclasses.Field) -> str:
    """The config key of a section's field: its name, or the one it is given where the name cannot be it."""
    return item.metadata.get("key", item.name)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` as type ``hint`` (ints become floats where floats are wanted, lists become tuples), or a clear error."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} is not one of the accepted types {_describe(hint)}.")
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        raise ConfigError(f"{key}={value!r} is not one of {list(args)}.")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list.")
        return tuple(_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} must be a list of {len(args)} values.")
        return tuple(_coerce(item, arg, f"{key}[{i}]") for i, (item, arg) in enumerate(zip(value, args, strict=True)))
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}={value!r} is not null.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be a number.") from None
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false.")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}={value!r} must be an integer.")
    if hint in (str, float) and not isinstance(value, hint):
        raise ConfigError(f"{key}={value!r} must be a {hint.__name__}.")
    return value


def _describe(hint: Any) -> str:
    return " | ".join(getattr(arg, "__name__", repr(arg)) for arg in typing.get_args(hint))


def _validate(config: RecipeConfig) -> None:
    """Checks that need more than one key (each names the keys and the fix)."""
    train, model = config.train, config.model
    if not model.path:
        raise ConfigError("model.path is required: a hub id or a local checkpoint directory.")
    _validate_data(config)
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "seq_len", "loss_chunk_size"):
        if getattr(train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(train, key)} must be at least 1.")
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={train.micro_batch_size} (times the data-parallel size)."
        )
    if train.lr <= 0 or train.min_lr < 0 or train.min_lr > train.lr:
        raise ConfigError(f"train.lr={train.lr} must be > 0 and train.min_lr={train.min_lr} in [0, lr].")
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
    if layout.strategy == "megatron_fsdp":
        raise ConfigError("LoRA runs with layout.strategy=fsdp2 or ddp, not megatron_fsdp.")
    if layout.pp_size > 1 and config.export.dir and config.export.lora != "adapter":
        raise ConfigError(
            f"export.lora={config.export.lora} with lora.rank > 0 and layout.pp_size > 1: under pipeline parallelism "
            "the adapter is exported (export.lora=adapter); for the merged model, run again with layout.pp_size=1 "
            "(it resumes the final checkpoint of checkpoint.dir and exports)."
        )
    if importlib.util.find_spec("peft") is None:
        raise ConfigError('lora.rank > 0 needs the peft package: pip install "automodel[peft]".')
