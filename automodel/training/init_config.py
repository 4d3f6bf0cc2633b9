"""``automodel init-config sft|pretrain [--output DIR] [--force]``: write a runnable example config and its data set.

The examples ship inside the package (``automodel/training/examples``), so the command works from an installed wheel
outside any checkout; each one trains a tiny random model written on first use, in seconds, on CPU ranks.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from .config import RECIPES

__all__ = ["EXAMPLE_DATA", "main", "write_example_config"]

#: The data file each example config reads (``examples/data/<file>``).
EXAMPLE_DATA = {"sft": "smol_chat.jsonl", "pretrain": "tiny_corpus.txt"}


def write_example_config(recipe: str, output: str | Path, *, force: bool = False) -> Path:
    """Write ``<output>/<recipe>.yaml`` and ``<output>/data/<its data file>``; return the config's path.

    Existing files are kept (``FileExistsError`` naming them) unless ``force``.
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
    print(f"wrote {config} and its data; run it with:\n  automodel {args.recipe} --config {config} --nproc-per-node 2")
    return 0
