"""``automodel init-config sft|pretrain [--output DIR] [--force]``: write a runnable example config, its data set and
its tiny model.

The examples ship inside the package (``automodel/training/examples``), so the command works from an installed wheel
outside any checkout; each one trains a tiny random Llama, written here next to the config, in seconds, on CPU ranks.
The configs name that folder as ``model.path`` and nothing else: a mistyped path is refused before the run starts
(``model.tiny_if_missing``, which writes a random model wherever the path points, is for the project's own smoke
tests only).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from .config import RECIPES

__all__ = ["EXAMPLE_DATA", "EXAMPLE_MODEL", "main", "write_example_config"]

#: The data file each example config reads (``examples/data/<file>``).
EXAMPLE_DATA = {"sft": "smol_chat.jsonl", "pretrain": "tiny_corpus.txt"}
#: The folder of the tiny model the example configs name as ``model.path``.
EXAMPLE_MODEL = "tiny-llama"


def write_example_config(recipe: str, output: str | Path, *, force: bool = False) -> Path:
    """Write ``<output>/<recipe>.yaml``, ``<output>/data/<its data file>`` and the tiny random model it trains,
    ``<output>/tiny-llama`` (its tokenizer's vocabulary: the words of both examples' data); return the config's path.

    Existing files are kept (``FileExistsError`` naming them) unless ``force``; an existing tiny model is kept.
    """
    if recipe not in RECIPES:
        raise ValueError(f"no example config for recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    output = Path(output)
    examples = resources.files("automodel.training") / "examples"
    targets = {
        output / f"{recipe}.yaml": examples / f"{recipe}.yaml",
        output / "data" / EXAMPLE_DATA[recipe]: examples / "data" / EXAMPLE_DATA[recipe],
    }
    existing = [str(path) for path in targets if path.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist(s): pass --force to overwrite, or another --output")
    for target, source in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
    if not (output / EXAMPLE_MODEL / "config.json").is_file():
        from .tiny_model import write_tiny_model

        with resources.as_file(examples / "data") as data:  # both examples' words: one model serves both
            write_tiny_model(output / EXAMPLE_MODEL, data, seed=0)
    return output / f"{recipe}.yaml"


def main(argv: list[str]) -> int:
    """``automodel init-config`` entry point; returns the exit status (2 for existing files)."""
    parser = argparse.ArgumentParser(
        prog="automodel init-config", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("recipe", choices=RECIPES, help="which example to write")
    parser.add_argument("--output", default=".", help="folder to write into (default: the current one)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)
    try:
        config = write_example_config(args.recipe, args.output, force=args.force)
    except FileExistsError as error:
        print(f"automodel init-config: {error}", file=sys.stderr)
        return 2
    print(
        f"wrote {config}, its data and its tiny model; run it with:\n"
        f"  automodel {args.recipe} --config {config} --nproc-per-node 2"
    )
    return 0
