"""Recipe configuration: typed, frozen sections parsed from YAML once, at the recipe boundary.

A config file names the model, the layout (the ``MeshContext.build`` arguments), the data, the training schedule,
checkpointing and export. Command-line overrides use dotted keys (``train.lr=3e-4``). Unknown keys and bad values
are errors that name the key, raised before any process starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from .config_checks import check_world_size, pipeline_microbatches, validate_config, validate_vision_language
from .config_errors import ConfigError, duplicate_yaml_key, located, unknown_keys_error, yaml_key_lines
from .config_sections import (
    RECIPES,
    RESHARD_POLICIES,
    BlendSource,
    CheckpointSection,
    DataSection,
    ExportSection,
    LayoutSection,
    LogSection,
    LoraSection,
    MlflowSection,
    ModelSection,
    RecipeConfig,
    TrainSection,
    WandbSection,
    config_key,
)

__all__ = [
    "PATH_KEYS",
    "RECIPES",
    "RESHARD_POLICIES",
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
    "pipeline_microbatches",
    "validate_vision_language",
]

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
        duplicate = duplicate_yaml_key(text)
        if duplicate is not None:
            name, first, second = duplicate
            raise ConfigError(
                f"{path}:{second}: {name} is written twice (first at line {first}); YAML would keep this one and drop "
                "the first without a word. Write it once."
            )
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
    validate_config(config)
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
    names = {config_key(f): f.name for f in dataclasses.fields(cls)}
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
        if set(args) <= {str, type(None)}:
            _coerce(value, str, key)  # the string's own error, which says to quote the value
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
    if hint is str and isinstance(value, int | datetime.date) and not isinstance(value, bool):
        return str(value)  # YAML read a revision 1234 or a name 2024-06-01 as a number or a date: its text is meant
    if hint is str and not isinstance(value, str):
        raise ConfigError(f'{key}={value!r} must be a string: quote it ({key.rpartition(".")[2]}: "{value}").')
    if hint is float and not isinstance(value, float):
        raise ConfigError(f"{key}={value!r} must be a float.")
    return value


def _describe(hint: Any) -> str:
    return " | ".join(getattr(arg, "__name__", repr(arg)) for arg in typing.get_args(hint))
