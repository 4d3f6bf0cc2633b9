"""What ``automodel --help`` and a bare ``automodel`` print: the five commands, a line each, what is checked before
anything starts, and what the exit statuses mean (``docs/recipes.md`` has the long form)."""

from __future__ import annotations

import difflib

__all__ = ["COMMANDS", "EXIT_STATUSES", "EXIT_UPLOAD_FAILED", "overview", "unknown_command"]

#: The commands of ``automodel``, each with its one-line meaning.
COMMANDS = {
    "sft": "fine-tune a model on chat or prompt/completion data: automodel sft --config FILE [key=value ...]",
    "pretrain": "train a model from its config on text: automodel pretrain --config FILE [key=value ...]",
    "plan": "what each rank of a job would hold (or, --suggest, the fastest layouts that fit): automodel plan --model M --world-size N",
    "prepare-data": "tokenize a corpus once, for training at scale: automodel prepare-data --tokenizer T --input F ...",
    "init-config": "write a runnable example config, its data and its tiny model: automodel init-config sft|pretrain",
}

#: ``automodel sft|pretrain``: trained and exported, but ``export.push_to_hub``'s upload failed (the export is on disk).
EXIT_UPLOAD_FAILED = 3

#: The exit statuses of ``automodel sft|pretrain``, documented in ``--help`` and ``docs/recipes.md``.
EXIT_STATUSES = {
    0: "trained (or stopped by SIGTERM / SIGUSR1 with a checkpoint)",
    1: "a training process failed or hung (the last lines say which rank, how, and where the log is)",
    2: "refused before any process started: a config, data, model, layout or hub mistake (one line says which)",
    EXIT_UPLOAD_FAILED: "trained and exported to export.dir, but the upload to export.push_to_hub failed",
    130: "stopped by Ctrl-C, after saving a checkpoint",
}


def overview() -> str:
    """The text of ``automodel --help``: the commands, the checks before launch, the exit statuses, the path rule."""
    width = max(map(len, COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {meaning}" for name, meaning in COMMANDS.items())
    statuses = "\n".join(f"  {status:>5}  {meaning}" for status, meaning in EXIT_STATUSES.items())
    return f"""usage: automodel <command> [options]

Load Hugging Face checkpoints into parallelized models (FSDP2 / TP / PP / CP / EP) and train them.

commands:
{commands}

`automodel <command> --help` shows a command's options; `automodel sft --help` also lists every config key.

Before any process starts, `automodel sft|pretrain` checks the config (keys, values, the layout against the process
count and the model), the model (its config is readable), the data (every record parses and has the keys the recipe
needs), every output folder (writable), export.push_to_hub (a valid repo name, a token, the hub reachable), and,
with --gpu-memory, --gpu or a visible GPU, the layout's estimated peak per rank against the GPU's memory.

exit statuses of `automodel sft|pretrain`:
{statuses}
  128+N  killed by signal N

Relative paths in a config file, and the default log.dir, are relative to the file's folder; paths given on the
command line (key=value) are relative to the current directory."""


def unknown_command(name: str) -> str:
    """The one-line answer to ``automodel NAME`` when NAME is not a command: the commands, and the one meant."""
    match = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.5)
    hint = f"; did you mean `automodel {match[0]}`?" if match else "."
    return f"automodel: {name!r} is not a command{hint} The commands are {', '.join(COMMANDS)} (automodel --help)."
