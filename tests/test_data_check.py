"""Training data is checked before launch, streamed, at one position (``automodel.training.data_check``): every JSONL
line parses and is a record the recipe reads, parquet and arrow files have the recipe's columns with no row missing
a value; the ranks read JSONL through the same check. The real command refuses a broken line with exit 2 before any
process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from automodel.training import data_check
from automodel.training.data import load_records, load_texts
from automodel.training.data_check import DataError, check_data, check_jsonl, iter_jsonl
from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint
from tests.conftest import REPO

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _broken_at_41(path: Path) -> Path:
    """40 good chats, then a line missing a comma after its messages (column 49), then more good ones."""
    good = json.dumps(CHAT)
    return _jsonl(path, [good] * 40 + ['{"messages": [{"role": "user", "content": "x"}] "oops": 1}', good, good])


def test_a_broken_line_is_named_at_its_line_and_column(tmp_path):
    path = _broken_at_41(tmp_path / "chat.jsonl")
    with pytest.raises(DataError) as error:
        check_data(path, "sft")
    assert str(error.value) == f"{path}:41: not valid JSON (Expecting ',' delimiter at column 49)"
    with pytest.raises(DataError, match=r"chat.jsonl:41: not valid JSON \(Expecting ','"):
        load_records(path)  # the ranks' reader: the same check, the same message


@pytest.mark.parametrize(
    ("lines", "kind", "message"),
    [
        (['{"text": "a"}'], "sft", ":1: record has keys ['text']; expected a chat {'messages'"),
        (['{"prompt": "p"}'], "sft", ":1: record has keys ['prompt']; expected a chat"),
        (['{"messages": []}'], "sft", ":1: record: 'messages' must be a non-empty list"),
        (['{"messages": [{"role": "user"}]}'], "sft", ":1: record, message 0: expected {'role': str, 'content': str}"),
        (['{"prompt": 1, "completion": "c"}'], "sft", ":1: record, message 0: expected"),
        (['{"text": "a"}', "", '{"body": "b"}'], "pretrain", ":3: record has no string 'text' field (keys: ['body'])"),
        (["[1, 2]"], "sft", ":1: record is a JSON list, not an object"),
        (['{"a": 1} {"b": 2}'], "sft", ":1: not valid JSON (Extra data at column 10)"),
    ],
)
def test_each_mistake_is_named_at_one_position(tmp_path, lines, kind, message):
    path = _jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataError) as error:
        check_data(path, kind)
    assert str(error.value).startswith(f"{path}{message}"), error.value


def test_what_the_ranks_read_is_accepted(tmp_path):
    """Blank lines, CRLF endings, whitespace around a record, pairs, conversational pairs and vision-language parts
    (for a vision-language model only) pass; the count is of records."""
    pair = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
    lines = [
        json.dumps(CHAT) + "\r",
        "",
        "  " + json.dumps({"prompt": "p", "completion": "c"}) + "  ",
        json.dumps(pair),
    ]
    assert check_data(_jsonl(tmp_path / "a.jsonl", lines), "sft") == 3
    vision = {"messages": [{"role": "user", "content": [{"type": "image", "path": "x.png"}]}, CHAT["messages"][1]]}
    _jsonl(tmp_path / "v.jsonl", [json.dumps(vision)])
    assert check_data(tmp_path / "v.jsonl", "vlm") == 1
    with pytest.raises(DataError, match="message 0: expected"):
        check_data(tmp_path / "v.jsonl", "sft")
    assert check_data(CHAT_DATA, "sft") == len([line for line in CHAT_DATA.read_text().splitlines() if line.strip()])
    assert check_data(REPO / "recipes" / "data" / "tiny_corpus.txt", "pretrain") == 0, "text is the loader's"


def test_undecodable_bytes_and_lines_longer_than_a_block(tmp_path, monkeypatch):
    monkeypatch.setattr(data_check, "_BLOCK_BYTES", 16)
    long = json.dumps({"text": "x" * 100})
    path = _jsonl(tmp_path / "ok.jsonl", [long, "", long])
    assert [number for number, _ in iter_jsonl(path, "pretrain")] == [1, 3], "each long line whole, over many blocks"
    assert load_texts(path) == ["x" * 100, "x" * 100]
    path.write_bytes(f"{long}\n{long}\n".encode() + b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"ok.jsonl:3: not UTF-8 text \(invalid start byte\)"):
        check_data(path, "pretrain")


def test_a_byte_order_mark_at_the_start_of_a_file_is_not_part_of_its_text(tmp_path):
    """Windows editors save UTF-8 with a BOM; Python's ``utf-8-sig`` and ``datasets`` read past it, and so does this."""
    record = json.dumps({"text": "hello"})
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + f"{record}\n{record}\n".encode())
    assert check_data(jsonl, "pretrain") == 2
    assert [number for number, _ in iter_jsonl(jsonl, "pretrain")] == [1, 2]
    assert load_texts(jsonl) == ["hello", "hello"]
    text = tmp_path / "bom.txt"
    text.write_bytes(b"\xef\xbb\xbfhello")
    assert load_texts(text) == ["hello"]
    jsonl.write_bytes(b"\xef\xbb\xbf" + f"{record}\n".encode() + b"{\n")
    with pytest.raises(DataError, match=r"bom.jsonl:2: not valid JSON"):
        check_data(jsonl, "pretrain")


def test_a_file_split_among_processes_reports_the_first_mistake_at_its_line_in_the_file(tmp_path, monkeypatch):
    """Three checking processes, each given a third of the file from a line start; lines counted across them."""
    monkeypatch.setattr(data_check, "_PARALLEL_BYTES", 1)
    good = [json.dumps(CHAT)] * 300
    path = _jsonl(tmp_path / "big.jsonl", [*good[:250], "", "{oops", *good[:49], '{"text": 1}'])
    with pytest.raises(DataError) as error:
        check_jsonl(path, "sft", workers=3)
    assert str(error.value).startswith(f"{path}:252: not valid JSON (Expecting property name"), error.value
    assert check_jsonl(_jsonl(tmp_path / "fine.jsonl", good), "sft", workers=3) == 300
    monkeypatch.setattr(data_check.sys, "executable", "/bin/false")  # no checking process can start
    assert check_jsonl(tmp_path / "fine.jsonl", "sft", workers=3) == 300, "the checker's failure is not the data's"
    with pytest.raises(DataError, match=r"big.jsonl:252: not valid JSON"):
        check_jsonl(path, "sft", workers=3)


def test_a_folder_is_checked_file_by_file(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [json.dumps(CHAT)])
    _jsonl(tmp_path / "b.jsonl", [json.dumps(CHAT), '{"text": "t"}'])
    with pytest.raises(DataError, match=r"b.jsonl:2: record has keys \['text'\]"):
        check_data(tmp_path, "sft")
    (tmp_path / "b.jsonl").unlink()
    assert check_data(tmp_path, "sft") == 1
    _jsonl(tmp_path / "a.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no records in"):
        check_data(tmp_path, "sft")


def test_chats_and_pairs_mixed_in_a_table_are_read_row_by_row(tmp_path):
    """A table of chats and prompt / completion pairs (parquet, or JSON through pandas) has every column in every
    row, null where the row has none: a null field is an absent one, in tables and in JSONL alike."""
    from automodel.training.data_check import sft_messages

    pair = {"prompt": "Hi", "completion": "Hello!"}
    blank = {"messages": None, "prompt": None, "completion": None}  # every column in every row, as pandas writes
    pq.write_table(pa.Table.from_pylist([{**blank, **CHAT}, {**blank, **pair}]), tmp_path / "mixed.parquet")
    assert check_data(tmp_path / "mixed.parquet", "sft") == 2
    records = load_records(tmp_path / "mixed.parquet", kind="sft")
    assert [sft_messages(record) for record in records] == [
        CHAT["messages"],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    ]
    _jsonl(tmp_path / "nulls.jsonl", [json.dumps({"messages": None, **pair}), json.dumps({**CHAT, "prompt": None})])
    assert check_data(tmp_path / "nulls.jsonl", "sft") == 2
    neither = [{**blank, **CHAT}, {**blank, "prompt": "Hi"}]
    pq.write_table(pa.Table.from_pylist(neither), tmp_path / "neither.parquet")
    with pytest.raises(DataError, match=r"row 1 \(from 0\): neither 'messages' nor both 'prompt' and 'completion'"):
        check_data(tmp_path / "neither.parquet", "sft")


def test_a_folder_is_one_kind_of_data_file_and_split_by_file_names(tmp_path):
    """What the loader reads in a folder is what the check checks: one kind of data file (two kinds are refused,
    never one read and the other dropped), and where the file names say which split each holds (``datasets``'
    rule), the files of the split asked for."""
    pair = {"prompt": "p", "completion": "c"}
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _jsonl(mixed / "a.jsonl", [json.dumps(CHAT)])
    pq.write_table(pa.Table.from_pylist([CHAT]), mixed / "b.parquet")
    for read in (lambda: check_data(mixed, "sft"), lambda: load_records(mixed, kind="sft")):
        with pytest.raises(DataError, match=r"holds \.jsonl and \.parquet data files"):
            read()
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("a document")
    _jsonl(text / "b.jsonl", [json.dumps({"text": "another"})])
    with pytest.raises(DataError, match=r"holds \.jsonl and \.txt data files"):
        load_texts(text)
    (text / "a.txt").rename(text / "README.txt")  # beside chats, text files are not data: SFT reads the JSONL
    (text / "dataset_info.json").write_text("{}")
    _jsonl(text / "b.jsonl", [json.dumps(CHAT)])
    assert check_data(text, "sft") == 1 and len(load_records(text, kind="sft")) == 1

    splits = tmp_path / "splits"
    splits.mkdir()
    _jsonl(splits / "train.jsonl", [json.dumps(CHAT)] * 3)
    _jsonl(splits / "validation.jsonl", [json.dumps(pair)])
    assert check_data(splits, "sft") == 3 and check_data(splits, "sft", "validation") == 1
    assert load_records(splits, kind="sft") == [CHAT] * 3
    assert load_records(splits, kind="sft", split="validation") == [pair]
    with pytest.raises(DataError, match=r"holds the splits \['train', 'validation'\] \(by file name\) and not 'test'"):
        load_records(splits, kind="sft", split="test")
    _jsonl(splits / "notes.jsonl", [json.dumps(CHAT)])
    with pytest.raises(DataError, match=r"files of no split \(notes\.jsonl\)"):
        check_data(splits, "sft")


def test_a_saved_dataset_with_splits_gives_the_split_asked_for(tmp_path):
    import datasets

    pair = {"prompt": "p", "completion": "c"}
    train = datasets.Dataset.from_list([{"prompt": "t", "completion": "c"}] * 2)
    datasets.DatasetDict({"train": train, "validation": datasets.Dataset.from_list([pair])}).save_to_disk(
        tmp_path / "d"
    )
    assert len(load_records(tmp_path / "d", kind="sft")) == 2
    assert load_records(tmp_path / "d", kind="sft", split="validation") == [pair]


def test_parquet_and_arrow_rows_are_checked_batch_by_batch(tmp_path):
    empty_chat = {"messages": []}
    no_content = {"messages": [{"role": "user", "content": None}]}
    pq.write_table(pa.Table.from_pylist([CHAT, empty_chat]), tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([CHAT, CHAT, no_content]), tmp_path / "content.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": None}]), tmp_path / "text.parquet")
    problems = {
        "empty.parquet": "row 1 (from 0): 'messages' is empty",
        "content.parquet": "row 2 (from 0): a message without 'content'",
        "text.parquet": "row 1 (from 0): 'text' is null",
    }
    for name, message in problems.items():
        with pytest.raises(DataError) as error:
            check_data(tmp_path / name, "pretrain" if name.startswith("text") else "sft")
        assert str(error.value) == f"{tmp_path / name}: {message}"
    with pytest.raises(DataError, match=r"no column 'text' for `automodel pretrain` \(its columns: \['messages'\]\)"):
        check_data(tmp_path / "empty.parquet", "pretrain")
    pq.write_table(pa.Table.from_pylist([{"messages": "not a chat"}]), tmp_path / "typed.parquet")
    with pytest.raises(DataError, match="column 'messages' is string, not a list of"):
        check_data(tmp_path / "typed.parquet", "sft")
    table = pa.Table.from_pylist([CHAT] * 3 + [{"messages": None}])
    with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)  # what `datasets` writes: a stream, here of two batches
    with pytest.raises(DataError, match=r"data.arrow: row 3 \(from 0\): 'messages' is null"):
        check_data(tmp_path / "data.arrow", "sft")
    (tmp_path / "good").mkdir()
    pq.write_table(pa.Table.from_pylist([CHAT] * 3), tmp_path / "good" / "train.parquet")
    assert check_data(tmp_path / "good", "sft") == 3  # a folder of tables


@pytest.mark.distributed
def test_the_command_refuses_a_broken_line_before_any_process_starts(tmp_path):
    """A chat set with line 41 broken: exit 2 with one line naming `file:41` and the column, no process started (the
    log folder, made when the processes start, is not there)."""
    model = save_tiny_chat_checkpoint(tmp_path / "model")
    data = _broken_at_41(tmp_path / "chat.jsonl")
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {data.name}}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "automodel.training.cli", "sft", "--config", str(config), "--nproc-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"automodel: config error: data.path: {data}:41: not valid JSON (Expecting ',' delimiter at column 49)"
    )
    assert not (tmp_path / "automodel_logs").exists()
