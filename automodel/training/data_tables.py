"""Parquet and arrow training data checked batch by batch (``data_check.check_data``): the recipe's columns are there,
of the right type, and no row lacks a value, an empty chat or a message without role or content. Mistakes name the
row (``chat.parquet: row 12 (from 0): 'messages' is empty``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .data_errors import DataError

__all__ = ["check_table"]

#: The columns each recipe reads from a table, one set of them being enough.
_COLUMNS = {"sft": (("messages",), ("prompt", "completion")), "vlm": (("messages",),), "pretrain": (("text",),)}
_READERS = {
    "sft": "`automodel sft`",
    "vlm": "`automodel sft` of a vision-language model",
    "pretrain": "`automodel pretrain`",
}
_BATCH_ROWS = 65536


def check_table(path: Path, kind: str) -> int:
    """A parquet or arrow file of records of ``kind`` (``data_check.record_problem``), batch by batch: one of its
    column sets is there, of the right types, and no row lacks a value; the number of rows."""
    schema, batches = _open_table(path)
    columns = next((names for names in _COLUMNS[kind] if all(name in schema.names for name in names)), None)
    # Chats and prompt / completion pairs mixed in one table: each row has one or the other (the rest null).
    either = kind == "sft" and all(name in schema.names for name in ("messages", "prompt", "completion"))
    if either:
        columns = ("messages", "prompt", "completion")
    if columns is None:
        wanted = " or ".join(" + ".join(repr(name) for name in names) for names in _COLUMNS[kind])
        raise DataError(f"{path}: no column {wanted} for {_READERS[kind]} (its columns: {schema.names})")
    if "messages" in columns and not _is_chat_type(schema.field("messages").type, text_only=kind == "sft"):
        raise DataError(
            f"{path}: column 'messages' is {schema.field('messages').type}, not a list of {{role, content: string}} "
            "structs"
        )
    if "text" in columns and not _is_string(schema.field("text").type):
        raise DataError(f"{path}: column 'text' is {schema.field('text').type}, not strings")
    rows = 0
    for batch in batches(columns):
        table = pa.Table.from_batches([batch]).select(list(columns))
        problem = _batch_problem(table, either=either)
        if problem is not None:
            row, what = problem
            raise DataError(f"{path}: row {rows + row} (from 0): {what}")
        rows += table.num_rows
    return rows


def _open_table(path: Path):
    """``(schema, batches(columns))`` of a parquet file, or of an arrow IPC file or stream (what ``datasets`` saves)."""
    try:
        if path.suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            return parquet.schema_arrow, lambda columns: parquet.iter_batches(_BATCH_ROWS, columns=list(columns))
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable {path.suffix[1:]} file ({error})") from None
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return reader.schema, lambda columns: (reader.get_batch(i) for i in range(reader.num_record_batches))
    return reader.schema, lambda columns: iter(reader)


def _is_chat_type(kind, *, text_only: bool) -> bool:
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {kind.value_type.field(i).name: kind.value_type.field(i).type for i in range(kind.value_type.num_fields)}
    return "role" in fields and "content" in fields and (_is_string(fields["content"]) or not text_only)


def _is_string(kind) -> bool:
    return kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _batch_problem(table, *, either: bool = False) -> tuple[int, str] | None:
    """The first row of ``table`` (its rows' index, what is wrong) with a null value, an empty chat, or a message
    without role or content; ``None`` when every row is whole. ``either``: the table has 'messages', 'prompt' and
    'completion', and a row needs only the chat or the pair."""
    if either:
        no_pair = pc.or_(pc.is_null(table.column("prompt")), pc.is_null(table.column("completion")))
        neither = pc.and_(pc.is_null(table.column("messages")), no_pair)
        if pc.any(neither).as_py():
            return _first(neither), "neither 'messages' nor both 'prompt' and 'completion'"
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if column.null_count and not either:
            return _first(pc.is_null(column)), f"{name!r} is null"
        if name != "messages":
            continue
        empty = pc.equal(pc.list_value_length(column), 0)
        if pc.any(empty).as_py():
            return _first(empty), "'messages' is empty"
        messages = pc.list_flatten(column)
        parents = pc.list_parent_indices(column)
        for field in ("role", "content"):
            values = pc.struct_field(messages, field)
            if values.null_count:
                return parents[_first(pc.is_null(values))].as_py(), f"a message without {field!r}"
    return None


def _first(mask) -> int:
    return pc.index(mask, True).as_py()
