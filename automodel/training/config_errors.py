"""Config errors that say where the mistake is and what was meant: the ``ConfigError`` of the recipes, the "did you
mean" of an unknown key, and the ``file:line`` of a key written in a YAML file.

A key written in the YAML file is reported at its line (``sft.yaml:12: Unknown config key(s) train.learning_rate;
Did you mean train.lr? ...``); a key given as a command-line override is reported as it is, with no file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

import yaml

__all__ = ["ConfigError", "duplicate_yaml_key", "located", "unknown_keys_error", "yaml_key_lines"]


class ConfigError(ValueError):
    """A recipe config that cannot run: names the key and what to write instead. ``key`` (when one key is at fault)
    is its dotted name, for :func:`located` to find its line in the YAML file."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


#: Names users bring from other trainers (transformers' TrainingArguments, torchtitan, peft), by what they mean here.
_SYNONYMS = {
    "learning_rate": "lr",
    "min_learning_rate": "min_lr",
    "lr_min": "min_lr",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "training_steps": "max_steps",
    "batch_size": "global_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_clipping": "max_grad_norm",
    "grad_clip": "max_grad_norm",
    "max_seq_len": "seq_len",
    "max_length": "seq_len",
    "sequence_length": "seq_len",
    "seq_length": "seq_len",
    "warmup": "warmup_steps",
    "model_name": "path",
    "model_id": "path",
    "name_or_path": "path",
    "pretrained_model_name_or_path": "path",
    "output_dir": "dir",
    "r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "tensor_parallel_size": "tp_size",
    "context_parallel_size": "cp_size",
    "expert_parallel_size": "ep_size",
    "pipeline_parallel_size": "pp_size",
}


def unknown_keys_error(unknown: Iterable[str], accepted: Iterable[str], prefix: str) -> ConfigError:
    """The error for keys of the section ``prefix`` (``"train."``; ``""``: the top level) that it does not accept,
    with the accepted key each one most likely meant (a known synonym, else the closest spelling)."""
    unknown, accepted = sorted(map(str, unknown)), sorted(accepted)
    guesses = [f"{prefix}{guess}" for key in unknown if (guess := _meant(key, accepted))]
    hint = f" Did you mean {' / '.join(guesses)}?" if guesses else ""
    names = ", ".join(f"{prefix}{key}" for key in unknown)
    section = prefix.rstrip(".") or "the top level"
    return ConfigError(
        f"Unknown config key(s) {names};{hint} {section} accepts {accepted}.", key=f"{prefix}{unknown[0]}"
    )


def _meant(key: str, accepted: list[str]) -> str | None:
    synonym = _SYNONYMS.get(key.lower())
    if synonym in accepted:
        return synonym
    match = difflib.get_close_matches(key, accepted, n=1)
    return match[0] if match else None


def yaml_key_lines(text: str) -> dict[str, int]:
    """The 1-based line of every key in a YAML document, by dotted name (``train.lr``; list items as
    ``data.blend[0].path``). A document that is not a mapping has none."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}
    _walk(root, "", lines)
    return lines


def duplicate_yaml_key(text: str) -> tuple[str, int, int] | None:
    """The first key a YAML mapping writes twice, as ``(dotted name, first line, second line)``: YAML keeps the last
    value and drops the first without a word (a second ``train:`` section replaces the whole first one)."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return None
    return _first_duplicate(root, "")


def _first_duplicate(node: yaml.Node | None, prefix: str) -> tuple[str, int, int] | None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name, line = f"{prefix}{key.value}", key.start_mark.line + 1
            if key.value != "<<" and name in seen:
                return name, seen[name], line
            seen[name] = line
            found = _first_duplicate(value, f"{name}.")
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found = _first_duplicate(item, f"{prefix.rstrip('.')}[{index}].")
            if found is not None:
                return found
    return None


def _walk(node: yaml.Node | None, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{prefix}{key.value}"
            lines.setdefault(name, key.start_mark.line + 1)
            _walk(value, f"{name}.", lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, f"{prefix.rstrip('.')}[{index}].", lines)


def located(error: ConfigError, path: Path | None, lines: dict[str, int], overridden: Iterable[str]) -> ConfigError:
    """``error`` prefixed with ``file:line:`` when its key (or the nearest section above it) was written in the YAML
    file at ``path`` and not replaced by a command-line override; else ``error`` itself."""
    key = error.key
    if path is None or key is None or any(key == name or key.startswith(f"{name}.") for name in overridden):
        return error
    while key and key not in lines:
        key = key.rpartition(".")[0]
    if not key:
        return error
    return ConfigError(f"{path}:{lines[key]}: {error}", key=error.key)
