"""Prepared data: a corpus tokenized once by ``automodel prepare-data`` into flat token files, read by every rank
window by window, so that a rank's memory does not grow with the corpus (the small per-document arrays are
memory-mapped; token windows are read with ``os.pread``: see :class:`_File`).

A prepared folder holds ``manifest.json`` and one or more parts (``part-00000``, ``part-00001`` ... each ``prepare-data``
run that appends adds one), each with:

- ``tokens.bin``: every document's token ids, one after another (``uint16`` when the vocabulary fits, else
  ``uint32``); a pretraining document ends in EOS unless it was prepared with ``--no-append-eos``;
- ``documents.bin``: ``int64`` offsets of the documents in ``tokens.bin`` (documents + 1 of them, from 0 to the token
  count);
- SFT only: ``loss_mask.bin`` (``uint8``, 1 where a token is a training target: an assistant reply and its
  end-of-turn token) and ``first_target.bin`` (``int64``, the position of each document's first target, so that the
  documents a ``seq_len`` truncation would leave without a target are skipped without reading them).

The manifest names the tokenizer (its name and a hash of its whole definition, the chat template included), the
dtype, the counts, the sources (path, size, mtime) and the automodel version. Nothing in it depends on when or where
it was written, so the same inputs give the same bytes.

Reading (:class:`PreparedExamples`) gives exactly what the in-memory path gives for the same data, in the same order:
pretraining windows ``tokens[i * seq_len : (i + 1) * seq_len]`` of the whole stream (the last partial one dropped),
SFT documents truncated to ``seq_len``, or greedily packed into ``seq_len`` sequences at the same boundaries as
:func:`~.data.pack_examples`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .data import Example, pack_examples

__all__ = [
    "MANIFEST",
    "PreparedDataError",
    "PreparedExamples",
    "is_prepared",
    "read_manifest",
    "tokenizer_fingerprint",
]

MANIFEST = "manifest.json"
FORMAT = "automodel.prepared"
VERSION = 1
TOKENS, DOCUMENTS, LOSS_MASK, FIRST_TARGET = "tokens.bin", "documents.bin", "loss_mask.bin", "first_target.bin"


class PreparedDataError(ValueError):
    """A prepared folder that cannot be read as it is: names the file and how to fix it."""


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``automodel prepare-data``."""
    return (Path(path) / MANIFEST).is_file()


def tokenizer_fingerprint(tokenizer: Any, *, chat: bool = False) -> str:
    """A hash of everything that decides the token ids: the tokenizer's whole definition (a fast tokenizer's JSON:
    vocabulary, merges, normalizer, pre-tokenizer, added tokens), its special tokens, and with ``chat`` its chat
    template. Two tokenizers with the same fingerprint tokenize every text the same way."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [definition, json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id])]
    if chat:
        parts.append(str(getattr(tokenizer, "chat_template", None)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def token_dtype(vocabulary_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocabulary_size <= 2**16 else np.dtype(np.uint32)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a prepared folder, after checking that every part's files are there, whole, and agree with
    it and with each other (a missing or truncated token file, an index that does not match it ...)."""
    folder = Path(path)
    manifest_file = folder / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except FileNotFoundError:
        raise PreparedDataError(
            f"{folder} has no {MANIFEST}: it is not a folder `automodel prepare-data` wrote."
        ) from None
    except (OSError, ValueError) as error:
        raise PreparedDataError(
            f"{manifest_file} cannot be read ({error}): prepare the data again with `automodel prepare-data`."
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise PreparedDataError(
            f"{manifest_file} is not a version-{VERSION} {FORMAT} manifest: prepare the data again with this version "
            "of `automodel prepare-data`."
        )
    if not manifest["parts"] or manifest["tokens"] == 0:
        raise PreparedDataError(f"{folder} holds no tokens: its sources were empty. Prepare it from non-empty data.")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for part in manifest["parts"]:
        _check_part(folder / part["name"], part, itemsize, manifest["kind"] == "sft")
    return manifest


def _check_part(folder: Path, part: dict[str, Any], itemsize: int, sft: bool) -> None:
    again = "prepare the data again (`automodel prepare-data ... --output` a new folder)"
    expected = {TOKENS: part["tokens"] * itemsize, DOCUMENTS: (part["documents"] + 1) * 8}
    if sft:
        expected |= {LOSS_MASK: part["tokens"], FIRST_TARGET: part["documents"] * 8}
    for name, size in expected.items():
        file = folder / name
        if not file.is_file():
            raise PreparedDataError(f"{file} is missing: {again}.")
        if file.stat().st_size != size:
            raise PreparedDataError(
                f"{file} holds {file.stat().st_size} bytes where the manifest says {size} (truncated or from "
                f"another run): {again}."
            )
    offsets = np.memmap(folder / DOCUMENTS, dtype=np.int64, mode="r")
    if offsets[0] != 0 or offsets[-1] != part["tokens"] or (part["documents"] and np.any(np.diff(offsets) < 0)):
        raise PreparedDataError(
            f"{folder / DOCUMENTS} does not index {folder / TOKENS} (its offsets must rise from 0 to the "
            f"{part['tokens']} tokens): {again}."
        )


@dataclass
class _Part:
    tokens: _File
    offsets: np.memmap
    loss_mask: _File | None
    first_target: np.memmap | None
    start: int  # the part's first token in the whole stream


class _File:
    """A token-sized array in a file, read by ``os.pread`` into a fresh buffer.

    Not a memory map, for the token and loss-mask files: a mapped page read stays in the process's resident set,
    and the kernel maps its neighbours along with it (fault-around, 64 KiB), so random windows over a long run would
    grow every rank's RSS towards the size of the file. A read costs one system call and leaves nothing resident
    (the page cache, shared by the ranks of a node, still serves it)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.length = path.stat().st_size // self.dtype.itemsize
        self._descriptor: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, stop: int) -> np.ndarray:
        if self._descriptor is None or self._pid != os.getpid():  # a forked process opens its own
            self._descriptor, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        size = self.dtype.itemsize
        data = os.pread(self._descriptor, (stop - start) * size, start * size)
        return np.frombuffer(data, dtype=self.dtype)


class PreparedCorpus:
    """The token stream and documents of a prepared folder, memory-mapped (nothing is read until asked for)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.kind: str = self.manifest["kind"]
        dtype = np.dtype(self.manifest["dtype"])
        self._parts: list[_Part] = []
        start = 0
        for part in self.manifest["parts"]:
            folder = self.path / part["name"]
            sft = self.kind == "sft"
            self._parts.append(
                _Part(
                    _File(folder / TOKENS, dtype),
                    np.memmap(folder / DOCUMENTS, dtype=np.int64, mode="r"),
                    _File(folder / LOSS_MASK, np.dtype(np.uint8)) if sft else None,
                    np.memmap(folder / FIRST_TARGET, dtype=np.int64, mode="r") if sft else None,
                    start,
                )
            )
            start += part["tokens"]
        self.tokens: int = start
        self._starts = np.array([part.start for part in self._parts], dtype=np.int64)
        counts = np.array([part["documents"] for part in self.manifest["parts"]], dtype=np.int64)
        self._document_ends = np.cumsum(counts)
        self.documents = int(counts.sum())

    def span(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the whole stream (across parts where the span crosses one's end)."""
        pieces = []
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            part = self._parts[index]
            local = start - part.start
            end = min(stop - part.start, len(part.tokens))
            pieces.append(part.tokens.read(local, end))
            start = part.start + end
            index += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, index: int, limit: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``limit`` tokens of document ``index`` and, for SFT, their loss mask."""
        part, local = self._locate(index)
        begin = int(part.offsets[local])
        end = min(int(part.offsets[local + 1]), begin + limit)
        mask = None if part.loss_mask is None else part.loss_mask.read(begin, end)
        return part.tokens.read(begin, end), mask

    def document_lengths(self) -> np.ndarray:
        """Every document's token count (``int64``, one pass over the offsets)."""
        return np.concatenate([np.diff(part.offsets) for part in self._parts])

    def first_targets(self) -> np.ndarray:
        """SFT: every document's first target position."""
        return np.concatenate([np.asarray(part.first_target) for part in self._parts])

    def _locate(self, index: int) -> tuple[_Part, int]:
        part = int(np.searchsorted(self._document_ends, index, side="right"))
        return self._parts[part], index - int(self._document_ends[part - 1] if part else 0)


class PreparedExamples(Sequence[Example]):
    """The training examples of a prepared folder for one ``seq_len``, read on demand: what the in-memory path
    (``tokenize_pretraining``, ``tokenize_sft``, ``pack_examples``) gives for the same data, in the same order."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, *, packing: bool = False, pad_id: int = 0) -> None:
        self.corpus, self.seq_len, self.packing, self.pad_id = corpus, seq_len, packing, pad_id
        if corpus.kind == "pretrain":
            self._count = corpus.tokens // seq_len
            if self._count == 0:
                raise PreparedDataError(
                    f"{corpus.path} holds {corpus.tokens} tokens, fewer than one sequence of seq_len={seq_len}."
                )
            return
        # SFT: the documents with a target within seq_len (tokenize_sft drops the others), as int64 indices.
        self._documents = np.flatnonzero(corpus.first_targets() < seq_len)
        if len(self._documents) == 0:
            raise PreparedDataError(f"{corpus.path}: no document has a training target within seq_len={seq_len}.")
        self._groups = _pack_boundaries(corpus.document_lengths()[self._documents], seq_len) if packing else None
        self._count = len(self._groups) - 1 if packing else len(self._documents)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        if not 0 <= index < self._count:
            raise IndexError(f"example {index} of {self._count}")
        if self.corpus.kind == "pretrain":
            window = self.corpus.span(index * self.seq_len, (index + 1) * self.seq_len).tolist()
            return Example(window, list(window))
        if self._groups is None:
            return self._document(int(self._documents[index]))
        members = self._documents[self._groups[index] : self._groups[index + 1]]
        (packed,) = pack_examples([self._document(int(member)) for member in members], self.seq_len, self.pad_id)
        return packed

    def _document(self, index: int) -> Example:
        tokens, mask = self.corpus.document(index, self.seq_len)
        ids = tokens.tolist()
        return Example(ids, np.where(mask.astype(bool), tokens.astype(np.int64), -100).tolist())


def _pack_boundaries(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Where ``pack_examples`` starts each packed sequence over documents of these (truncated) lengths: greedy, in
    order, a document that does not fit starting the next sequence. Returns group starts plus the end."""
    lengths = np.minimum(lengths, seq_len).tolist()
    starts, used = [0], 0
    for index, length in enumerate(lengths):
        if used + length > seq_len:
            starts.append(index)
            used = 0
        used += length
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)
