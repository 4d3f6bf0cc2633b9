"""Training records checked one by one, streamed: the check the ``automodel`` command runs on ``data.path`` before it
starts any process, and the one the ranks run as they read the data (``data.load_records``).

JSONL is read line by line and parquet / arrow batch by batch, so a file of any size is checked in bounded memory (a
1 GB JSONL file in seconds). A mistake is reported at one position: ``chat.jsonl:41: not valid JSON (Expecting ','
delimiter at column 197)``, ``chat.jsonl:7: record has keys ['text']; expected a chat {'messages': [...]} or a pair
{'prompt', 'completion'}``, ``chat.parquet: row 12 (from 0): 'messages' is empty``.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

from .data_errors import DataError

__all__ = [
    "DataError",
    "check_data",
    "check_jsonl",
    "data_files",
    "folder_files",
    "iter_jsonl",
    "record_problem",
    "sft_messages",
    "split_of",
]

_TABLES = (".parquet", ".arrow")
_BLOCK_BYTES = 4 << 20  # JSONL is decoded this much at a time
_PARALLEL_BYTES = 128 << 20  # and checked by one more process per this much
_SCAN = json.JSONDecoder().scan_once  # the C scanner behind json.loads


def record_problem(record: Any, kind: str) -> str | None:
    """What makes ``record`` unusable as a record of ``kind`` (``"sft"``, ``"pretrain"``, or ``"vlm"``: an SFT chat of
    a vision-language model, whose contents may be lists of text and image parts), or ``None``. The text follows the
    word naming the record, with its own separator: ``f"SFT record 3{problem}"``, ``f"{file}:41: record{problem}"``."""
    if not isinstance(record, dict):
        return f" is a JSON {type(record).__name__}, not an object"
    if kind == "pretrain":
        if isinstance(record.get("text"), str):
            return None
        return f" has no string 'text' field (keys: {sorted(record)}); pretraining records look like {{'text': '...'}}"
    # A null field is an absent one: a table (parquet, a JSON array through pandas) of chats and pairs mixed has
    # every column in every row, null where a row has none.
    if record.get("messages") is not None or (
        record.get("prompt") is not None and record.get("completion") is not None
    ):
        return _messages_problem(sft_messages(record), (str, list) if kind == "vlm" else str)
    return (
        f" has keys {sorted(record)}; expected a chat {{'messages': [{{'role', 'content'}}, ...]}} or a pair "
        "{'prompt', 'completion'}"
    )


def sft_messages(record: dict) -> Any:
    """An SFT record's messages: its ``messages``, or its prompt / completion pair as a user and an assistant turn (a
    conversational pair, whose parts are message lists, joined)."""
    if record.get("messages") is not None:
        return record["messages"]
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        return prompt + completion
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def _messages_problem(messages: Any, content: type | tuple[type, ...]) -> str | None:
    if not isinstance(messages, list) or not messages:
        return ": 'messages' must be a non-empty list of {'role', 'content'} dicts"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), content) or "role" not in message:
            shown = repr(message) if len(repr(message)) <= 80 else repr(message)[:77] + "..."
            expected = "str" if content is str else "str or a list of parts"
            return f", message {turn}: expected {{'role': str, 'content': {expected}}}, got {shown}"
        if message.get("tool_calls") and message["role"] == "assistant":
            return (
                f", message {turn}: an assistant turn with 'tool_calls' is not trained here: the loss mask covers the "
                "messages' contents, and the calls the chat template renders from 'tool_calls' would go untrained. "
                "Write each call into 'content' as the model should emit it"
            )
    return None


class _Mistake(Exception):
    """A line's mistake inside this module: its line number (from 1, within the range read) and message."""

    def __init__(self, number: int, message: str) -> None:
        super().__init__(message)
        self.number, self.message = number, message


def iter_jsonl(path: str | Path, kind: str | None = None) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of a JSONL file, read in blocks of whole lines. A line that is
    not UTF-8, not a JSON object, or (with ``kind``) not a record of that kind (:func:`record_problem`) raises
    :class:`DataError` naming ``file:line``."""
    path = Path(path)
    try:
        for number, line in _lines(path, 0, path.stat().st_size):
            if line and not line.isspace():
                yield number, _record(number, line, kind)
    except _Mistake as mistake:
        raise DataError(f"{path}:{mistake.number}: {mistake.message}") from None


def check_jsonl(path: str | Path, kind: str, *, workers: int | None = None) -> int:
    """Check every line of a JSONL file as :func:`iter_jsonl` does (keeping no record); the number of records. A
    file of more than ``_PARALLEL_BYTES`` per worker is split at line starts into ranges checked by up to ``workers``
    processes (default: the CPUs, at most 8); the first mistake in the file is reported at its line."""
    path = Path(path)
    size = path.stat().st_size
    workers = max(1, min(workers or os.cpu_count() or 1, 8, size // _PARALLEL_BYTES))
    bounds = [*_line_starts(path, [size * part // workers for part in range(workers)]), size]
    jobs = [(path, start, stop, kind) for start, stop in pairwise(bounds)]
    outcomes = [_check_range(*jobs[0])] if workers == 1 else _in_processes(jobs)
    lines_before = records = 0
    for lines, count, mistake in outcomes:
        if mistake is not None:
            raise DataError(f"{path}:{lines_before + mistake[0]}: {mistake[1]}")
        lines_before, records = lines_before + lines, records + count
    return records


def _in_processes(jobs: list[tuple[Path, int, int, str]]) -> list[tuple[int, int, tuple[int, str] | None]]:
    """:func:`_check_range` of each job in a fresh interpreter of its own, all at once; a job whose process fails (it
    could not start, or was killed) is checked here instead. Not ``multiprocessing``: its spawn and forkserver start
    methods run the caller's ``__main__`` again (a script, a notebook), and fork copies a process that may run torch's
    threads."""
    command = [sys.executable, "-c", "from automodel.training.data_check import _range_worker; _range_worker()"]
    package_root = str(Path(__file__).resolve().parents[2])  # importable as here, installed or from a checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    workers = [
        subprocess.Popen(
            [*command, str(path), str(start), str(stop), kind],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for path, start, stop, kind in jobs
    ]
    outcomes = []
    for worker, job in zip(workers, jobs, strict=True):
        output, _ = worker.communicate()
        if worker.returncode:
            outcomes.append(_check_range(*job))  # the checker failed, not the data: check this part here
            continue
        lines, records, mistake = json.loads(output)
        outcomes.append((lines, records, None if mistake is None else tuple(mistake)))
    return outcomes


def _range_worker() -> None:
    """A checking process (:func:`_in_processes`): ``PATH START STOP RECIPE`` in, the JSON of its outcome out."""
    path, start, stop, kind = sys.argv[1:]
    print(json.dumps(_check_range(Path(path), int(start), int(stop), kind)))


def _check_range(path: Path, start: int, stop: int, kind: str) -> tuple[int, int, tuple[int, str] | None]:
    """(lines in the byte range, records in it, its first mistake as (line within the range, message) or None)."""
    lines = records = 0
    try:
        for lines, line in _lines(path, start, stop):
            if line and not line.isspace():
                _record(lines, line, kind)
                records += 1
    except _Mistake as mistake:
        return lines, records, (mistake.number, mistake.message)
    return lines, records, None


def _record(number: int, line: str, kind: str | None) -> Any:
    """The record of one line, checked: a JSON object, and with ``kind`` one of that kind."""
    record = _parsed(number, line)
    problem = record_problem(record, kind or "sft") if kind or not isinstance(record, dict) else None
    if problem is not None:
        raise _Mistake(number, f"record{problem}")
    return record


def _parsed(number: int, line: str) -> Any:
    """The JSON value of one line: the C scanner ``json.loads`` runs, called directly (a third less time per line),
    else ``json.loads`` itself for a line the scanner does not take whole (whitespace before the value, or a mistake,
    whose message it gives)."""
    try:
        value, end = _SCAN(line, 0)
        if end == len(line) or line[end:].isspace():
            return value
    except (StopIteration, json.JSONDecodeError):
        pass
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise _Mistake(number, f"not valid JSON ({error.msg} at column {error.colno})") from None


def _lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, str]]:
    """``(line number from 1 within the range, text)`` of every line of the byte range ``[start, stop)`` (``start`` at
    a line start), decoded a block of whole lines at a time; an undecodable byte is a mistake at its line. A UTF-8
    byte-order mark at the start of the file is skipped, as ``encoding="utf-8-sig"`` and ``datasets`` do."""
    number = 0
    with path.open("rb") as file:
        if start == 0 and file.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8:
            start = len(codecs.BOM_UTF8)  # a byte-order mark (as Windows editors write) is not part of line 1
        file.seek(start)
        left, tail = stop - start, b""
        while left > 0 or tail:
            chunk = file.read(min(_BLOCK_BYTES, left))
            left = left - len(chunk) if chunk else 0  # a file that shrank meanwhile ends here
            block = tail + chunk
            cut = block.rfind(b"\n") + 1 if left > 0 else len(block)  # whole lines; the rest goes with the next block
            block, tail = block[:cut], block[cut:]
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError as error:
                at = number + block.count(b"\n", 0, error.start) + 1
                raise _Mistake(at, f"not UTF-8 text ({error.reason})") from None
            pieces = text.split("\n")
            if pieces[-1] == "":
                pieces.pop()
            for piece in pieces:
                number += 1
                yield number, piece


def _line_starts(path: Path, offsets: list[int]) -> list[int]:
    """Each offset moved forward to the start of the line after it (0 stays 0)."""
    starts = []
    with path.open("rb") as file:
        for offset in offsets:
            if offset:
                file.seek(offset - 1)
                file.readline()
            starts.append(file.tell() if offset else 0)
    return starts


# The data files a folder's records are read from (``folder_files``). ``.json`` is data only in a folder of nothing
# else (beside other data it is metadata), ``.txt`` only for pretraining (each file one document).
_RECORD_SUFFIXES = (".jsonl", ".parquet", ".arrow", ".csv")
# ``datasets``' names for the files of a split (``train.jsonl``, ``data-validation-00000.parquet``, ``dev.csv``).
_SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEPARATOR = "[-._ 0-9]"


def split_of(name: str) -> str | None:
    """The split a data file's name puts it in, by ``datasets``' rule (a split's word at the start of the name or
    between separators: ``train.jsonl``, ``my_valid_set.parquet``), or ``None``."""
    lower = name.lower()
    for split, words in _SPLIT_WORDS.items():
        for word in words:
            if re.match(f"{word}{_SEPARATOR}", lower) or re.search(f"{_SEPARATOR}{word}{_SEPARATOR}", lower):
                return split
    return None


def folder_files(folder: str | Path, kind: str, split: str = "train") -> list[Path]:
    """The data files directly in ``folder`` that the records of ``split`` are read from, sorted by name: one kind of
    file (a folder holding JSONL and parquet, or for pretraining text and JSONL, is refused: which one was meant?);
    where the names say which split each file holds (``datasets``' rule, :func:`split_of`), the files of ``split``,
    else all of them. ``[]`` when the folder has no data file of its own (``datasets`` may still read its
    subfolders)."""
    folder = Path(folder)
    files = [item for item in sorted(folder.iterdir()) if item.is_file()]
    suffixes = _RECORD_SUFFIXES + ((".txt",) if kind == "pretrain" else ())
    data = [item for item in files if item.suffix in suffixes] or [item for item in files if item.suffix == ".json"]
    kinds = sorted({item.suffix for item in data})
    if len(kinds) > 1:
        raise DataError(
            f"{folder} holds {' and '.join(kinds)} data files; a folder is read as one kind of file. Move the others "
            "to a folder of their own (or point at one file)."
        )
    splits = {item: split_of(item.name) for item in data}
    if not any(splits.values()):
        return data
    unnamed = [item.name for item, named in splits.items() if named is None]
    if unnamed:
        raise DataError(
            f"{folder} holds files named for a split ({', '.join(sorted({s for s in splits.values() if s}))}) and "
            f"files of no split ({', '.join(unnamed[:3])}): name every file for its split, or move the others out."
        )
    chosen = [item for item, named in splits.items() if named == split]
    if not chosen:
        raise DataError(
            f"{folder} holds the splits {sorted(set(splits.values()))} (by file name) and not {split!r}: point at "
            "the files of the split you mean."
        )
    return chosen


def data_files(path: str | Path, kind: str = "sft", split: str = "train") -> list[Path]:
    """The files of ``path`` whose records :func:`check_data` checks: a JSONL, parquet or arrow file itself; in a
    folder, its JSONL, parquet or arrow files of ``split`` (:func:`folder_files`: what the loader reads there), else
    every parquet / arrow file under it (a folder ``datasets`` reads)."""
    path = Path(path)
    if path.is_file():
        return [path] if path.suffix in (".jsonl", *_TABLES) else []
    if not path.is_dir():
        return []
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        return []  # a saved dataset: the loader reads it (and picks its split)
    own = folder_files(path, kind, split)
    if own:
        return [item for item in own if item.suffix in (".jsonl", *_TABLES)]
    return sorted(file for file in path.rglob("*") if file.suffix in _TABLES and file.is_file())


def check_data(path: str | Path, kind: str, split: str = "train") -> int:
    """Check every record of the JSONL, parquet and arrow files at ``path`` (:func:`data_files`) of ``kind``,
    streamed; the number of records checked. Raises :class:`DataError` at the first mistake, or when the files hold
    no record at all. Other formats (text, csv, hub datasets, prepared folders) are left to the loader."""
    files = data_files(path, kind, split)
    count = 0
    for file in files:
        if file.suffix == ".jsonl":
            count += check_jsonl(file, kind)
        else:
            from .data_tables import check_table

            count += check_table(file, kind)
    if files and not count:
        raise DataError(
            f"{path}: no records in {', '.join(str(file) for file in files)}: there is nothing to train on."
        )
    return count
