"""``automodel prepare-data``: tokenize a corpus once, in parallel worker processes, into a prepared folder
(``automodel.training.prepared``) that every rank of every run then memory-maps.

    automodel prepare-data --tokenizer PATH_OR_ID --input FILE_OR_DIR [...] --output DIR
        [--format text|jsonl|parquet|arrow] [--text-key text] [--kind pretrain|sft] [--workers K] [--no-append-eos]

Documents are read in the order given (a folder's files sorted by name): a ``.txt`` file is one document (as
``data.path`` reads it), a JSONL line, a parquet or arrow row is one record, whose ``--text-key`` field is the text
(pretraining) or which is a chat (``--kind sft``: ``{"messages": [...]}`` or ``{"prompt", "completion"}``, rendered
with the tokenizer's chat template and masked as ``tokenize_sft`` masks it). Worker processes tokenize chunks of
documents; the chunks are written in order, so the output does not depend on ``--workers``.

Each run writes one new part under a staging name and renames it when it is complete, then replaces the manifest:
an interrupted run leaves the folder as it was (its staging part is removed by the next run). A run into a folder that
holds prepared data appends to it, and refuses a different tokenizer, kind or EOS setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .data_check import split_of
from .prepared import (
    DOCUMENTS,
    FIRST_TARGET,
    FORMAT,
    LOSS_MASK,
    MANIFEST,
    TOKENS,
    VERSION,
    PreparedDataError,
    token_dtype,
    tokenizer_fingerprint,
)

__all__ = ["main", "prepare"]

logger = logging.getLogger(__name__)

_FORMATS = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_CHUNK_DOCUMENTS = 256
_PROGRESS_SECONDS = 2.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="automodel prepare-data",
        description="Tokenize a corpus once into memory-mapped token files that training reads window by window "
        "(docs/recipes.md, 'Data at scale').",
    )
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer: a local folder or a hub id")
    parser.add_argument("--input", required=True, nargs="+", help="files or folders, read in this order")
    parser.add_argument("--output", required=True, help="the prepared folder (created, or appended to)")
    parser.add_argument("--format", choices=sorted(set(_FORMATS.values())), help="default: from each file's suffix")
    parser.add_argument("--text-key", default="text", help="the text field of a record (pretraining; default text)")
    parser.add_argument("--kind", choices=("pretrain", "sft"), default="pretrain", help="what the data trains")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizing processes")
    parser.add_argument(
        "--append-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end each pretraining document with EOS, as data.path's in-memory reading does (default: yes)",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code")
    return parser


def main(argv: list[str]) -> int:
    """The command; its exit status (2 for bad input, with one message)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.workers < 1:
        print("automodel prepare-data: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        manifest = prepare(
            args.tokenizer,
            [Path(path) for path in args.input],
            Path(args.output),
            kind=args.kind,
            file_format=args.format,
            text_key=args.text_key,
            workers=args.workers,
            append_eos=args.append_eos,
            trust_remote_code=args.trust_remote_code,
        )
    except (ValueError, FileNotFoundError) as error:  # PreparedDataError, and a bad JSONL line
        print(f"automodel prepare-data: {error}", file=sys.stderr)
        return 2
    print(
        f"automodel prepare-data: {args.output} holds {manifest['documents']:,} documents, {manifest['tokens']:,} "
        f"tokens ({manifest['dtype']}) in {len(manifest['parts'])} part(s)"
    )
    return 0


def prepare(
    tokenizer: str,
    inputs: list[Path],
    output: Path,
    *,
    kind: str = "pretrain",
    file_format: str | None = None,
    text_key: str = "text",
    workers: int = 1,
    append_eos: bool = True,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into a new part of ``output``; the manifest written."""
    files = _input_files(inputs, file_format)
    existing = _existing_manifest(output)
    created = not output.exists()  # removed again if this run fails: nothing half-written stays
    staging = None
    context = multiprocessing.get_context("fork")
    # The pool is forked before the tokenizer runs here (a tokenizer used before a fork disables its parallelism).
    pool = (
        context.Pool(workers, _start_worker, (tokenizer, trust_remote_code, kind, append_eos)) if workers > 1 else None
    )
    try:
        loaded = _load_tokenizer(tokenizer, trust_remote_code)
        fingerprint = tokenizer_fingerprint(loaded, chat=kind == "sft")
        dtype = token_dtype(len(loaded))
        settings = {"kind": kind, "append_eos": append_eos, "dtype": dtype.name}
        if existing is not None:
            _check_appendable(output, existing, fingerprint, settings)
            _check_not_prepared_yet(output, existing, files)
        if pool is None:
            _start_worker(tokenizer, trust_remote_code, kind, append_eos, loaded=loaded)
        name = f"part-{len(existing['parts']) if existing else 0:05d}"
        for stale in output.glob("*.staging"):
            shutil.rmtree(stale)
        staging = output / f"{name}.staging"
        staging.mkdir(parents=True)
        part = _write_part(staging, files, kind, text_key, dtype, pool)
        if part["documents"] == 0 or part["tokens"] == 0:
            raise PreparedDataError(
                f"{', '.join(map(str, inputs))}: no documents with tokens to prepare (empty source)."
            )
    except BaseException:
        if created:
            shutil.rmtree(output, ignore_errors=True)
        elif staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    staging.rename(output / name)
    part["name"] = name
    parts = [*(existing["parts"] if existing else []), part]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        **settings,
        "tokenizer": {"name": getattr(loaded, "name_or_path", str(tokenizer)), "hash": fingerprint},
        "vocabulary_size": len(loaded),
        "documents": sum(item["documents"] for item in parts),
        "tokens": sum(item["tokens"] for item in parts),
        "parts": parts,
        "automodel_version": _version(),
    }
    partial = output / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(partial, output / MANIFEST)  # the commit point of this run
    return manifest


def _version() -> str:
    from automodel import __version__

    return __version__


def _load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise PreparedDataError(f"--tokenizer {name}: cannot load it ({error}).") from None


def _input_files(inputs: list[Path], file_format: str | None) -> list[tuple[Path, str]]:
    """Every input file with its format, in order (a folder's files sorted by name)."""
    files: list[tuple[Path, str]] = []
    for path in inputs:
        if not path.exists():
            raise PreparedDataError(f"--input {path}: no such file or folder.")
        candidates = sorted(item for item in path.iterdir() if item.is_file()) if path.is_dir() else [path]
        for candidate in candidates:
            chosen = file_format or _FORMATS.get(candidate.suffix)
            if chosen is None:
                if path.is_dir():
                    continue  # a folder's other files (a README, a lock file ...)
                raise PreparedDataError(
                    f"--input {candidate}: unknown suffix {candidate.suffix!r}; pass --format {'|'.join(sorted(set(_FORMATS.values())))}."
                )
            files.append((candidate, chosen))
        if path.is_dir() and not candidates:
            raise PreparedDataError(f"--input {path} is an empty folder (empty source).")
        splits = sorted({split for candidate in candidates if (split := split_of(candidate.name)) is not None})
        if path.is_dir() and len(splits) > 1:
            raise PreparedDataError(
                f"--input {path} holds the files of the splits {splits} (by file name): prepare each split apart "
                "(--input the split's files), so that no held-out record is trained on."
            )
    if not files:
        raise PreparedDataError(f"--input {' '.join(map(str, inputs))}: no file of a known format (empty source).")
    return files


def _existing_manifest(output: Path) -> dict[str, Any] | None:
    if (output / MANIFEST).is_file():
        from .prepared import read_manifest

        return read_manifest(output)
    if output.exists() and (not output.is_dir() or any(p for p in output.iterdir() if not p.name.endswith(".staging"))):
        raise PreparedDataError(
            f"--output {output} exists and is not a prepared folder: give a new folder, or one prepare-data wrote."
        )
    return None


def _check_appendable(output: Path, manifest: dict[str, Any], fingerprint: str, settings: dict[str, Any]) -> None:
    if manifest["tokenizer"]["hash"] != fingerprint:
        raise PreparedDataError(
            f"--output {output} was prepared with the tokenizer {manifest['tokenizer']['name']} (hash "
            f"{manifest['tokenizer']['hash'][:12]}), not this one: appending would mix two vocabularies. Prepare into "
            "a new folder, or pass the manifest's tokenizer."
        )
    for key, value in settings.items():
        if manifest[key] != value:
            raise PreparedDataError(f"--output {output} holds {key}={manifest[key]}, this run {value}: not appendable.")


def _check_not_prepared_yet(output: Path, manifest: dict[str, Any], files: list[tuple[Path, str]]) -> None:
    """An input file the folder already holds (the same path, size and modification time) would be trained on twice."""
    for part in manifest["parts"]:
        held = {(source["path"], source["size"], source["mtime"]) for source in part.get("sources", ())}
        for path, _ in files:
            stat = path.stat()
            if (str(path.resolve()), stat.st_size, stat.st_mtime) in held:
                raise PreparedDataError(
                    f"--output {output} already holds {path} ({part['name']}, the same size and modification time): "
                    "appending it again would train on it twice. Prepare it into another folder."
                )


# -------------------------------------------------------------------------------------------- reading and writing


def _documents(files: list[tuple[Path, str]], kind: str, text_key: str) -> Iterator[tuple[str, Any]]:
    """``(where, document)`` in order: a text for pretraining, a record for SFT."""
    for path, file_format in files:
        if file_format == "text":
            if kind == "sft":
                raise PreparedDataError(f"--input {path}: SFT data is chat records (JSONL, parquet, arrow), not text.")
            yield str(path), path.read_text(encoding="utf-8-sig")
            continue
        for where, record in _records(path, file_format):
            if kind == "sft":
                yield where, record
            elif not isinstance(record.get(text_key), str):
                chat = record.get("messages") is not None or record.get("prompt") is not None
                fix = "these are SFT records: pass --kind sft" if chat else "pass --text-key (the field holding it)"
                raise PreparedDataError(f"{where} has no string {text_key!r} field (keys: {sorted(record)}); {fix}.")
            else:
                yield where, record[text_key]


def _records(path: Path, file_format: str) -> Iterator[tuple[str, dict]]:
    if file_format == "jsonl" and path.suffix == ".json" and _starts_an_array(path):
        records = json.loads(path.read_text(encoding="utf-8-sig"))  # a JSON array, as `datasets` reads .json too
        for index, record in enumerate(records):
            if not isinstance(record, dict):
                raise PreparedDataError(f"{path} item {index} is a JSON {type(record).__name__}, not an object.")
            yield f"{path} item {index}", record
        return
    if file_format == "jsonl":
        from .data import iter_jsonl

        for number, record in iter_jsonl(path):
            yield f"{path} line {number}", record
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    if file_format == "parquet":
        batches = pq.ParquetFile(path).iter_batches()
    else:
        try:
            batches = pa.ipc.open_stream(pa.memory_map(str(path)))  # what `datasets` writes
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))  # Arrow's file format
            batches = (reader.get_batch(index) for index in range(reader.num_record_batches))
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path} row {row}", record
            row += 1


def _starts_an_array(path: Path) -> bool:
    """Whether a ``.json`` file holds one JSON array (else it is read as JSON lines)."""
    with path.open("rb") as file:
        head = file.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


class _Buffers:
    """The part's files, appended to chunk by chunk."""

    def __init__(self, folder: Path, kind: str, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.files = {TOKENS: (folder / TOKENS).open("wb"), DOCUMENTS: (folder / DOCUMENTS).open("wb")}
        if kind == "sft":
            self.files |= {LOSS_MASK: (folder / LOSS_MASK).open("wb"), FIRST_TARGET: (folder / FIRST_TARGET).open("wb")}
        self.tokens = 0
        self.documents = 0
        self.files[DOCUMENTS].write(np.zeros(1, dtype=np.int64).tobytes())

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        self.files[TOKENS].write(chunk["tokens"].astype(self.dtype).tobytes())
        self.files[DOCUMENTS].write((np.cumsum(chunk["lengths"]) + self.tokens).astype(np.int64).tobytes())
        if LOSS_MASK in self.files:
            self.files[LOSS_MASK].write(chunk["loss_mask"].astype(np.uint8).tobytes())
            self.files[FIRST_TARGET].write(chunk["first_target"].astype(np.int64).tobytes())
        self.tokens += int(chunk["lengths"].sum())
        self.documents += len(chunk["lengths"])

    def close(self) -> None:
        for file in self.files.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()


def _write_part(staging: Path, files, kind: str, text_key: str, dtype: np.dtype, pool) -> dict[str, Any]:
    buffers = _Buffers(staging, kind, dtype)
    chunks = _chunks(_documents(files, kind, text_key))
    results = pool.imap(_tokenize_chunk, chunks) if pool is not None else map(_tokenize_chunk, chunks)
    started = last_report = time.perf_counter()
    read_bytes = 0
    for chunk in results:
        buffers.add(chunk)
        read_bytes += chunk["bytes"]
        if time.perf_counter() - last_report >= _PROGRESS_SECONDS:
            last_report = time.perf_counter()
            _progress(buffers, read_bytes, last_report - started)
    buffers.close()
    _progress(buffers, read_bytes, time.perf_counter() - started)
    sources = [
        {"path": str(path.resolve()), "size": path.stat().st_size, "mtime": path.stat().st_mtime} for path, _ in files
    ]
    return {"documents": buffers.documents, "tokens": buffers.tokens, "sources": sources}


def _progress(buffers: _Buffers, read_bytes: int, seconds: float) -> None:
    logger.info(
        "prepare-data: %s documents, %s tokens, %.1f MB/s",
        f"{buffers.documents:,}",
        f"{buffers.tokens:,}",
        read_bytes / 1e6 / max(seconds, 1e-9),
    )


def _chunks(documents: Iterator[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    chunk: list[tuple[str, Any]] = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == _CHUNK_DOCUMENTS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ------------------------------------------------------------------------------------------------ worker processes

_WORKER: dict[str, Any] = {}


def _start_worker(name: str, trust_remote_code: bool, kind: str, append_eos: bool, loaded=None) -> None:
    _WORKER.update(
        tokenizer=loaded if loaded is not None else _load_tokenizer(name, trust_remote_code),
        kind=kind,
        append_eos=append_eos,
    )


def _tokenize_chunk(chunk: list[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """One chunk's tokens and per-document lengths (and for SFT the loss mask and first targets), as
    ``tokenize_pretraining`` / ``tokenize_sft`` would produce them."""
    tokenizer, kind = _WORKER["tokenizer"], _WORKER["kind"]
    documents = [document for _, document in chunk]
    size = sum(len(json.dumps(document)) if kind == "sft" else len(document.encode()) for document in documents)
    if kind == "sft":
        return _tokenize_chats(chunk, tokenizer) | {"bytes": size}
    eos = tokenizer.eos_token_id
    if eos is None and _WORKER["append_eos"]:
        raise PreparedDataError(
            f"{type(tokenizer).__name__} has no eos_token to end documents with; pass --no-append-eos."
        )
    ids = tokenizer(documents)["input_ids"]
    if _WORKER["append_eos"]:
        ids = [item if item and item[-1] == eos else [*item, eos] for item in ids]
    lengths = np.array([len(item) for item in ids], dtype=np.int64)
    tokens = np.fromiter((token for item in ids for token in item), dtype=np.int64, count=int(lengths.sum()))
    return {"tokens": tokens, "lengths": lengths, "bytes": size}


def _tokenize_chats(chunk: list[tuple[str, Any]], tokenizer) -> dict[str, np.ndarray]:
    from .data import IGNORE_INDEX, tokenize_sft

    try:
        examples = tokenize_sft([record for _, record in chunk], tokenizer, 2**62)  # truncated when read
    except ValueError as error:
        raise PreparedDataError(f"{chunk[0][0]} .. {chunk[-1][0]}: {error}") from None
    lengths = np.array([len(example.input_ids) for example in examples], dtype=np.int64)
    tokens = np.fromiter(
        (t for example in examples for t in example.input_ids), dtype=np.int64, count=int(lengths.sum())
    )
    targets = np.fromiter(
        (label != IGNORE_INDEX for example in examples for label in example.labels), dtype=np.uint8, count=len(tokens)
    )
    first = np.array(
        [next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX) for example in examples],
        dtype=np.int64,
    )
    return {"tokens": tokens, "lengths": lengths, "loss_mask": targets, "first_target": first}
