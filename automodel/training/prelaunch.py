"""What the ``automodel`` command checks before it starts any process: everything the config alone decides that would
otherwise fail only on the ranks, minutes (or hours, at the first save or the export) into the run.

Each check raises :class:`~.config.ConfigError` naming the key, its value and the fix; the command prints it and
exits with status 2 before torchrun starts.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

from .config import ConfigError, LayoutSection, RecipeConfig

__all__ = ["check_before_launch"]


def check_before_launch(config: RecipeConfig, world_size: int) -> list[str]:
    """The data paths exist and are not empty, every record of the local JSONL / parquet / arrow data is one the recipe
    reads (``data_check``), the model's config can be read (a local folder, or a hub id that is cached or can be
    fetched), the layout fits the model on ``world_size`` processes (the real run's checks), every output folder is a
    folder that exists or can be created, and is writable, and ``export.push_to_hub`` can upload (``hub_upload``).
    Returns the warnings: what the run would do that its user most likely did not mean."""
    from .loop import prepare_model

    if config.data.path:
        _check_data("data.path", config.data.path)
    for index, source in enumerate(config.data.blend):
        _check_data(f"data.blend[{index}].path", source.path)
    if config.data.validation_path is not None:
        _check_data("data.validation_path", config.data.validation_path)
    outputs = {
        "checkpoint.dir": config.checkpoint.dir,
        "export.dir": config.export.dir,
        "train.tensorboard_dir": config.train.tensorboard_dir,
        "log.dir": config.log.dir,
    }
    for key, value in outputs.items():
        if value is not None:
            _check_writable_folder(key, Path(value))
    _check_export_spares_the_model(config)
    if config.export.push_to_hub:
        from .hub_upload import check_push_to_hub

        check_push_to_hub(config.export.push_to_hub, config.export.dir)
    tiny = config.model.tiny_if_missing and not (Path(config.model.path) / "config.json").is_file()
    prepare_model(config)  # the tiny smoke-test model, written where model.tiny_if_missing asks for it
    model_directory = _check_model(config)
    _check_records(config, model_directory)
    _check_prepared(config)
    warnings = _check_layout(config, world_size)
    if tiny:
        warnings.append(
            f"model.tiny_if_missing: nothing was at model.path={config.model.path}, so a tiny RANDOM model was written "
            "there (a smoke test). For a real run, fix model.path and drop model.tiny_if_missing."
        )
    if config.checkpoint.dir is None and config.export.dir is None:
        warnings.append(
            "neither checkpoint.dir nor export.dir is set: the trained model will not be saved. Set export.dir=DIR "
            "(a checkpoint transformers loads) or checkpoint.dir=DIR (resumable training state)."
        )
    return warnings


def _check_prepared(config: RecipeConfig) -> None:
    """Prepared data (``automodel prepare-data``): whole, of the recipe's kind, and of the model's tokenizer."""
    from .prepared import is_prepared
    from .prepared_reading import check_prepared_data

    if not config.data.blend and not (config.data.path and is_prepared(config.data.path)):
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path, revision=config.model.revision)
    check_prepared_data(config, tokenizer)


def _check_layout(config: RecipeConfig, world_size: int) -> list[str]:
    """Rank 0 of the job simulated (``automodel.planning.layout_refusal``: the real build on meta and the real
    ``parallelize`` under a fake process group), so that a layout the model cannot take (heads against
    ``layout.tp_size``, experts against ``layout.ep_size``, layers against ``layout.pp_size`` ...) is refused with
    the real run's own message. A failure of the simulation itself is a warning, not a refusal: the run checks again."""
    from automodel.planning import layout_refusal

    from .plan_command import plan_arguments

    layout, options = plan_arguments(config, world_size)
    try:
        why = layout_refusal(config.model.path, world_size=world_size, layout=layout, **options)
    except Exception as error:  # noqa: BLE001 - any failure of the check itself must not stop a run that may work
        return [f"the layout could not be checked against the model before launch ({type(error).__name__}: {error})"]
    if why is None:
        return []
    chosen = [f"layout.{key}={value}" for key, value in config.to_dict()["layout"].items() if _non_default(key, value)]
    raise ConfigError(
        f"{', '.join(chosen) or 'the default layout'} on {world_size} processes does not fit model.path="
        f"{config.model.path}: {why}"
    )


def _non_default(key: str, value: object) -> bool:
    return value != getattr(LayoutSection(), key)


def _check_data(key: str, value: str) -> None:
    from .data import is_hub_dataset_id

    if is_hub_dataset_id(value):
        _check_hub_dataset(key, value)
        return
    path = Path(value)
    if not path.exists():
        raise ConfigError(f"{key}={value}: no such file or folder. Give a JSONL / text file, a folder of them, or a "
                          "local dataset folder.")  # fmt: skip
    if path.is_file() and path.stat().st_size == 0:
        raise ConfigError(f"{key}={value} is an empty file: there is nothing to train on.")
    if path.is_dir() and not any(item.is_file() for item in path.rglob("*")):
        raise ConfigError(f"{key}={value} is a folder without any file in it: there is nothing to train on.")
    unfinished = sorted(item.name for item in path.glob("*.staging")) if path.is_dir() else []
    if unfinished and not (path / "manifest.json").exists():
        raise ConfigError(
            f"{key}={value} holds an unfinished `automodel prepare-data` output ({unfinished[0]}, no manifest.json): "
            "the run that wrote it stopped. Run automodel prepare-data again."
        )


def _check_hub_dataset(key: str, value: str) -> None:
    """A hub dataset id needs ``datasets``; offline, it must be in the ``datasets`` cache (where an earlier online
    load put it: ``<HF_DATASETS_CACHE>/<org>___<name>``)."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(
            f'{key}={value} is a hub dataset id: reading it needs `datasets` (pip install "automodel[datasets]").'
        )
    from datasets import config as datasets_config
    from datasets.naming import camelcase_to_snakecase

    if not (datasets_config.HF_HUB_OFFLINE or getattr(datasets_config, "HF_DATASETS_OFFLINE", False)):
        return
    namespace, name = value.split("/")
    cached = Path(datasets_config.HF_DATASETS_CACHE) / f"{namespace}___{camelcase_to_snakecase(name)}"
    if not cached.is_dir():
        raise ConfigError(
            f"{key}={value} is a hub dataset id that is not in the datasets cache ({cached}) while offline "
            "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): load it once online, or give a local path."
        )


def _check_model(config: RecipeConfig) -> Path:
    """The same resolution ``automodel plan`` uses: a local folder, or the hub id's metadata in (or fetched into) the
    Hugging Face cache; then its ``config.json`` must parse. Returns the folder holding it."""
    from automodel.loading.hub import HubOptions, resolve_config_dir

    model = config.model
    options = HubOptions(revision=model.revision, trust_remote_code=model.trust_remote_code)
    try:
        directory = resolve_config_dir(model.path, options)
    except (FileNotFoundError, OSError, ValueError) as error:
        raise ConfigError(f"model.path={model.path}: {error}") from None
    config_file = directory / "config.json"
    try:
        json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model.path={model.path}: {config_file} does not exist; model.path must be a checkpoint folder (the one "
            "holding config.json) or a hub id."
        ) from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.path={model.path}: {config_file} cannot be read as JSON: {error}") from None
    return directory


def _check_records(config: RecipeConfig, model_directory: Path) -> None:
    """Every record of the local JSONL, parquet and arrow data parses and has what the recipe reads (the check the
    ranks run as they read it: ``data_check``), streamed; a mistake is refused at its file and line (or row). For
    SFT also refused: a text file, fewer records than one global batch, and a tokenizer without a chat template."""
    from .data_check import DataError, check_data
    from .prepared import is_prepared
    from .vlm import IMAGE_TEXT_TO_TEXT, model_kind

    kind = config.recipe
    trust = config.model.trust_remote_code
    if (
        kind == "sft"
        and model_kind(str(model_directory), config.model.kind, trust_remote_code=trust) == IMAGE_TEXT_TO_TEXT
    ):
        kind = "vlm"  # chats whose contents may be lists of text and image parts
    raw = [value for value in (config.data.path, config.data.validation_path) if value and not is_prepared(value)]
    if kind == "sft" and raw:  # prepared SFT data is tokenized already
        _check_chat_template(config, model_directory)
    sources = (
        ("data.path", config.data.path, config.data.split),
        ("data.validation_path", config.data.validation_path, "validation"),
    )
    for key, value, split in sources:
        if not value or not Path(value).exists() or is_prepared(value):
            continue
        if kind != "pretrain" and Path(value).suffix == ".txt":
            raise ConfigError(
                f"{key}={value} is a text file: SFT reads chat records ({{'messages': [...]}} or prompt / completion "
                "pairs) from JSONL, parquet, arrow, csv or json. Text is for `automodel pretrain`."
            )
        try:
            count = check_data(value, kind, split)
        except DataError as error:
            raise ConfigError(f"{key}: {error}") from None
        # An SFT record is one example at most (packing joins them); pretraining cuts documents into sequences.
        if key == "data.path" and kind != "pretrain" and 0 < count < config.train.global_batch_size:
            raise ConfigError(
                f"{key}={value} holds {count} records, fewer than one global batch of train.global_batch_size="
                f"{config.train.global_batch_size}: add data or lower train.global_batch_size."
            )


def _check_chat_template(config: RecipeConfig, model_directory: Path) -> None:
    """SFT renders chats with the tokenizer's chat template: a tokenizer saved without one (a base model's) is refused
    here, not after the ranks have loaded the model. Only where the tokenizer's files are in the model's folder."""
    tokenizer_config = model_directory / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return
    if any((model_directory / name).exists() for name in ("chat_template.jinja", "chat_template.json")):
        return
    if (model_directory / "additional_chat_templates").is_dir():
        return
    try:
        if json.loads(tokenizer_config.read_text()).get("chat_template"):
            return
    except (OSError, ValueError):
        return  # the loader says what is wrong with it
    raise ConfigError(
        f"model.path={config.model.path}: its tokenizer has no chat template, so SFT chats cannot be rendered. Use "
        "an instruction-tuned model's tokenizer, or add a chat_template.jinja to the model's folder."
    )


def _check_export_spares_the_model(config: RecipeConfig) -> None:
    """The export replaces the weight files in ``export.dir`` (as ``save_pretrained`` does): in ``model.path`` they are
    the weights the run starts from, and resumes from."""
    if config.export.dir is None or not Path(config.model.path).is_dir():
        return
    if Path(config.export.dir).resolve() == Path(config.model.path).resolve():
        raise ConfigError(
            f"export.dir={config.export.dir} is model.path: the export would replace the weights this run starts (and "
            "resumes) from. Export to another folder."
        )


def _check_writable_folder(key: str, path: Path) -> None:
    """``path`` is a folder, or can be created, and a file can be written in it: probed by creating and removing a
    file (and any folders created for the probe)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} exists and is not a folder: give a folder (it is created if missing).")
    missing = []
    ancestor = path
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{key}={path}: {ancestor} is a file, so the folder cannot be created.")
    probe = path / f".automodel-write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"{key}={path} is not writable ({error.strerror or error}): choose a folder this user can write to."
        ) from None
    finally:
        for created in missing:  # innermost first: only what the probe made, and only while empty
            try:
                created.rmdir()
            except OSError:
                break
