"""Data for the SFT and pretraining recipes: load records, tokenize, pack, and batch them deterministically.

SFT records are chats (``{"messages": [{"role", "content"}, ...]}``) or prompt/completion pairs, rendered with the
model's own chat template. The loss mask is computed here, not by the template: many templates (SmolLM2's among
them) have no ``{% generation %}`` markers, so transformers cannot tell which tokens the assistant wrote.
Pretraining texts are concatenated (each followed by EOS) and cut into fixed-length sequences.
Batching is ``automodel.training.batches``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IGNORE_INDEX",
    "Example",
    "load_records",
    "load_texts",
    "pack_examples",
    "tokenize_pretraining",
    "tokenize_sft",
]

from .data_check import folder_files, iter_jsonl, record_problem, sft_messages

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ACCEPTED_FORMATS = (
    "a .jsonl file, a folder of .jsonl files, a .json/.csv/.parquet/.arrow/.txt file, a folder `datasets` can load, "
    "or a dataset directory written by `Dataset.save_to_disk`"
)
_DATASETS_BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
# Private-use characters that bracket each assistant content while the template renders, to find it afterwards.
_START, _END = "\ue000", "\ue001"


@dataclass(frozen=True)
class Example:
    """One training sequence; ``labels`` has the same length, ``-100`` where no loss is taken. ``position_ids``
    (packed sequences only) restart at 0 for every example packed into it; ``None`` means ``0, 1, 2, ...``.
    ``padding``: how many of the tokens are the padding a packed sequence ends in. A vision-language example also
    carries ``media``, the processor's image tensors (``pixel_values``, grid / size tensors; batched by concatenation
    along their first dimension), and ``token_inputs``, its per-token inputs besides the ids (``token_type_ids``,
    ``mm_token_type_ids``; padded with 0)."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    padding: int = 0
    media: dict[str, Any] | None = None
    token_inputs: dict[str, list[int]] | None = None

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"Example has {len(self.input_ids)} input_ids but {len(self.labels)} labels")
        if self.position_ids is not None and len(self.position_ids) != len(self.input_ids):
            raise ValueError(f"Example has {len(self.input_ids)} input_ids but {len(self.position_ids)} position_ids")


# ---------------------------------------------------------------------------------------------------------- loading


def is_hub_dataset_id(value: str | Path) -> bool:
    """Whether ``value`` names a Hugging Face hub dataset (``org/name``) rather than a local path: it does not exist
    here, has exactly one ``/`` and no data file suffix."""
    text = str(value)
    return (
        not Path(text).exists()
        and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None
        and Path(text).suffix not in (*_DATASETS_BUILDERS, ".jsonl")
    )


def load_records(
    path: str | Path,
    *,
    cache_dir: str | Path | None = None,
    split: str = "train",
    name: str | None = None,
    kind: str | None = None,
) -> list[dict]:
    """Read the records at ``path``: a JSONL file, a folder of JSONL files (sorted by name), or anything
    ``datasets.load_dataset`` reads locally (json/csv/parquet/arrow files or folders) or ``load_from_disk`` reads
    (a saved dataset dir; its ``train`` split when it holds several), or a hub dataset id (``org/name``: its
    ``split``, of its configuration ``name``, through ``datasets`` and its cache, which is all it reads offline).
    ``cache_dir`` is passed to ``datasets``. JSONL lines are checked as they are read (``data_check``: with
    ``kind``, ``"sft"``, ``"vlm"`` or ``"pretrain"``, also as records of that kind), a mistake named at its
    ``file:line``."""
    if is_hub_dataset_id(path):
        return _load_hub_dataset(str(path), split, name, cache_dir)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Data path {str(path)!r} does not exist; expected {ACCEPTED_FORMATS}")
    if path.is_file() and path.suffix == ".jsonl":
        return [record for _, record in iter_jsonl(path, kind)]
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _load_saved_dataset(path, split)
        files = folder_files(path, kind or "sft", split)
        if files and files[0].suffix == ".jsonl":
            return [record for file in files for _, record in iter_jsonl(file, kind)]
        if files:
            builder = _DATASETS_BUILDERS[files[0].suffix]
            return _load_with_datasets(path, builder, [str(file) for file in files], cache_dir, split)
        return _load_with_datasets(path, str(path), data_files=None, cache_dir=cache_dir, split=split)
    builder = _DATASETS_BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"Cannot read {str(path)!r}: unknown file type {path.suffix!r}; expected {ACCEPTED_FORMATS}")
    return _load_with_datasets(path, builder, data_files=str(path), cache_dir=cache_dir)


def load_texts(
    path: str | Path, *, cache_dir: str | Path | None = None, split: str = "train", name: str | None = None
) -> list[str]:
    """Pretraining documents: a ``.txt`` file is one document, a folder of ``.txt`` files one document per file
    (sorted by name); anything else goes through ``load_records`` and each record's ``"text"`` field is a document."""
    if is_hub_dataset_id(path):
        records = load_records(path, cache_dir=cache_dir, split=split, name=name)
        return [_text_of(record, index, path) for index, record in enumerate(records)]
    path = Path(path)
    if path.is_file() and path.suffix == ".txt":
        return [path.read_text(encoding="utf-8-sig")]
    if path.is_dir() and not (path / "state.json").exists() and not (path / "dataset_dict.json").exists():
        files = folder_files(path, "pretrain", split)
        if files and files[0].suffix == ".txt":
            return [file.read_text(encoding="utf-8-sig") for file in files]
    records = load_records(path, cache_dir=cache_dir, split=split, kind="pretrain")
    return [_text_of(record, index, path) for index, record in enumerate(records)]


def _text_of(record: dict, index: int, path: str | Path) -> str:
    problem = record_problem(record, "pretrain")
    if problem is not None:
        raise ValueError(f"Record {index} of {str(path)!r}{problem}")
    return record["text"]


def _load_hub_dataset(dataset_id: str, split: str, name: str | None, cache_dir: str | Path | None) -> list[dict]:
    datasets = _import_datasets()
    try:
        dataset = datasets.load_dataset(
            dataset_id, name=name, split=split, cache_dir=None if cache_dir is None else str(cache_dir)
        )
    except Exception as error:  # datasets raises many types (offline: ConnectionError); name the id and the fix
        raise ValueError(
            f"data.path={dataset_id} (a hub dataset id, split {split!r}"
            f"{'' if name is None else f', configuration {name!r}'}) could not be loaded: {error}. Offline, the "
            "dataset must be in the `datasets` cache (HF_DATASETS_CACHE) from an earlier online load; or give a "
            "local path."
        ) from None
    return dataset.to_list()


def _import_datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"Reading this data needs the `datasets` library ({ACCEPTED_FORMATS}); install it with "
            "`pip install 'automodel[datasets]'`, or use JSONL, which needs nothing extra"
        ) from error
    return datasets


def _load_saved_dataset(path: Path, split: str) -> list[dict]:
    dataset = _import_datasets().load_from_disk(str(path))
    return _single_split(dataset, path, split).to_list()


def _load_with_datasets(
    path: Path, builder: str, data_files: str | list[str] | None, cache_dir: str | Path | None, split: str = "train"
) -> list[dict]:
    datasets = _import_datasets()
    cache_dir = None if cache_dir is None else str(cache_dir)
    try:
        dataset = datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir)
    except Exception as error:  # datasets raises many types; name the path and the formats instead
        raise ValueError(f"`datasets` could not read {str(path)!r} ({error}); expected {ACCEPTED_FORMATS}") from error
    return _single_split(dataset, path, split).to_list()


def _single_split(dataset: Any, path: Path, split: str = "train") -> Any:
    """The dataset itself, or the ``split`` split of a ``DatasetDict`` (its only split when it has one: a folder of
    files of no split is read as ``train``)."""
    if not hasattr(dataset, "keys"):
        return dataset
    if split in dataset:
        return dataset[split]
    if len(dataset) == 1:
        return next(iter(dataset.values()))
    raise ValueError(f"{str(path)!r} holds the splits {sorted(dataset)} and not {split!r}; choose one (data.split)")


# ------------------------------------------------------------------------------------------------------------- SFT


def tokenize_sft(records: list[dict], tokenizer: Any, seq_len: int) -> list[Example]:
    """Tokenize chat or prompt/completion records with ``tokenizer``'s chat template; loss on assistant tokens only.

    A prompt/completion record becomes a user + assistant chat (a conversational pair, whose prompt and completion
    are message lists, is joined). Labels are the input ids of the tokens overlapping each assistant message's content
    (surrounding whitespace excluded) and of the end-of-turn token the template emits right after it (the first
    special token, possibly after whitespace), so the model learns to stop; ``-100`` everywhere else. A token that
    straddles a content's edge (a byte-level ``" It"`` after ``"assistant:"``) is labelled. The template must render
    every assistant content once (trimming or other in-place changes are fine). Sequences are truncated to ``seq_len``; examples left
    without any labelled token are dropped (with a warning).
    """
    _check_positive(seq_len=seq_len)
    _check_chat_tokenizer(tokenizer)
    if not records:
        raise ValueError("No SFT records to tokenize: the data path holds no records")
    chats = [_as_chat(record, index) for index, record in enumerate(records)]
    rendered = (
        _render_chat(tokenizer, chat, index, record.get("tools"))
        for index, (chat, record) in enumerate(zip(chats, records, strict=True))
    )
    texts, spans = zip(*rendered, strict=True)
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    end_ids = _end_of_turn_ids(tokenizer)
    kept, first_trained = [], []  # first_trained: where each dropped example's first trained token is
    for index, text in enumerate(texts):
        input_ids = encoded["input_ids"][index]
        labels = _assistant_labels(input_ids, encoded["offset_mapping"][index], spans[index], text, end_ids)
        if any(label != IGNORE_INDEX for label in labels[:seq_len]):
            kept.append(Example(input_ids[:seq_len], labels[:seq_len]))
        else:
            first_trained.append(next((at for at, label in enumerate(labels) if label != IGNORE_INDEX), None))
    if first_trained:
        reaches = [at + 1 for at in first_trained if at is not None]
        why = (
            f"no assistant token within seq_len={seq_len} (the earliest is token {min(reaches)} of its example)"
            if reaches
            else "no assistant token at all (empty assistant turns)"
        )
        if not kept:
            raise ValueError(
                f"None of the {len(records)} SFT records is left to train on: {why}. Raise train.seq_len, or shorten "
                "the prompts (a long system message or a chat template's preamble counts too)."
            )
        logger.warning("Dropped %d of %d SFT examples with %s", len(first_trained), len(records), why)
    return kept


def _check_chat_tokenizer(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so SFT records cannot be rendered; use the tokenizer of "
            "an instruction-tuned model or set `tokenizer.chat_template` to a Jinja template"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; the assistant loss mask needs "
            "token offsets: load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )


def _as_chat(record: dict, index: int) -> list[dict]:
    """The record's messages: its ``messages``, or its prompt/completion turned into user + assistant."""
    problem = record_problem(record, "sft")
    if problem is not None:
        raise ValueError(f"SFT record {index}{problem}")
    messages = sft_messages(record)
    for turn, message in enumerate(messages):
        if _START in message["content"] or _END in message["content"]:
            raise ValueError(f"SFT record {index}, message {turn} contains the reserved characters U+E000/U+E001")
    return messages


def _render_chat(
    tokenizer: Any, messages: list[dict], index: int, tools: list | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat (with the record's ``tools``, as TRL renders them) and the character span of each assistant
    content in it.

    The chat is rendered twice: as is, and with each assistant content's non-whitespace core bracketed by markers
    (so a trimming template keeps them). Removing the markers must give the plain rendering back, with one marked
    span per assistant message; otherwise the template dropped, repeated or rewrote a content.
    """
    marked_messages = [_mark_assistant(message) for message in messages]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    marked = tokenizer.apply_chat_template(marked_messages, tools=tools, tokenize=False)
    unmarked, spans = _remove_markers(marked)
    assistant_turns = sum(message["role"] == "assistant" for message in messages)
    if unmarked != text or len(spans) != assistant_turns:
        raise ValueError(
            f"SFT record {index}: the chat template does not render each assistant content exactly once (it drops, "
            "repeats or rewrites them depending on their text), so the assistant-only loss mask cannot be placed; use "
            "a template that renders every message['content']"
        )
    return text, spans


def _mark_assistant(message: dict) -> dict:
    if message["role"] != "assistant":
        return message
    content = message["content"]
    core = content.strip()
    lead = content[: len(content) - len(content.lstrip())]
    return {**message, "content": f"{lead}{_START}{core}{_END}{content[len(lead) + len(core) :]}"}


def _remove_markers(marked: str) -> tuple[str, list[tuple[int, int]]]:
    pieces, spans, position, length = [], [], 0, 0
    while (start := marked.find(_START, position)) >= 0:
        end = marked.find(_END, start)
        if end < 0:
            break
        pieces += [marked[position:start], marked[start + 1 : end]]
        length += start - position
        spans.append((length, length + end - start - 1))
        length += end - start - 1
        position = end + 1
    pieces.append(marked[position:])
    return "".join(pieces), spans


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _assistant_labels(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], text: str, end_ids: set[int]
) -> list[int]:
    labels = [IGNORE_INDEX] * len(input_ids)
    token = 0
    for span_start, span_end in spans:
        while token < len(offsets) and offsets[token][1] <= span_start:
            token += 1
        while token < len(offsets) and offsets[token][0] < span_end:
            labels[token] = input_ids[token]
            token += 1
        token = _label_end_of_turn(input_ids, offsets, token, text, end_ids, labels)
    return labels


def _label_end_of_turn(
    input_ids: list[int], offsets: list[tuple[int, int]], token: int, text: str, end_ids: set[int], labels: list[int]
) -> int:
    """Label the whitespace and the first special token right after a content; nothing if other text comes first."""
    for candidate in range(token, len(input_ids)):
        if input_ids[candidate] in end_ids:
            labels[token : candidate + 1] = input_ids[token : candidate + 1]
            return candidate + 1
        start, end = offsets[candidate]
        if text[start:end].strip():
            break
    return token


# --------------------------------------------------------------------------------------------------------- packing


def pack_examples(examples: list[Example], seq_len: int, pad_id: int) -> list[Example]:
    """Greedily concatenate whole examples, in order, into sequences of exactly ``seq_len``.

    An example that does not fit in the current sequence starts the next one, and the current one is padded with
    ``pad_id`` / ``-100``: examples are never split (the end of an answer without its prompt teaches nothing), so
    every sequence, not only the last, may end in padding. Each packed example keeps its own positions (its
    ``position_ids`` restart at 0, the padding's too), from which transformers builds a block-diagonal causal mask:
    no example attends to another, and no example's last token is trained to predict the next example's first (its
    label is ``-100``), so packing changes the cost, not what the model learns.
    """
    _check_positive(seq_len=seq_len)
    packed, input_ids, labels, positions = [], [], [], []
    for index, example in enumerate(examples):
        if len(example.input_ids) > seq_len:
            raise ValueError(f"Example {index} has {len(example.input_ids)} tokens > seq_len={seq_len}; truncate it")
        if len(input_ids) + len(example.input_ids) > seq_len:
            packed.append(_padded(input_ids, labels, positions, seq_len, pad_id))
            input_ids, labels, positions = [], [], []
        input_ids += example.input_ids
        # The first token is never a target of its own example (the loss shifts labels by one): here it would be the
        # previous example's last prediction.
        labels += [IGNORE_INDEX] + example.labels[1:]
        positions += range(len(example.input_ids))
    if input_ids:
        packed.append(_padded(input_ids, labels, positions, seq_len, pad_id))
    return packed


def _padded(input_ids: list[int], labels: list[int], positions: list[int], seq_len: int, pad_id: int) -> Example:
    padding = seq_len - len(input_ids)
    return Example(
        input_ids + [pad_id] * padding, labels + [IGNORE_INDEX] * padding, positions + list(range(padding)), padding
    )


# ----------------------------------------------------------------------------------------------------- pretraining


def tokenize_pretraining(texts: list[str], tokenizer: Any, seq_len: int) -> list[Example]:
    """Tokenize each text (with the tokenizer's own special tokens, e.g. a BOS), append EOS, concatenate everything
    and cut it into sequences of exactly ``seq_len`` with ``labels = input_ids``; a final partial one is dropped."""
    _check_positive(seq_len=seq_len)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token to separate documents")
    stream: list[int] = []
    for ids in tokenizer(list(texts))["input_ids"]:
        stream += ids if ids and ids[-1] == eos else [*ids, eos]
    count = len(stream) // seq_len
    if count == 0:
        raise ValueError(f"The texts hold {len(stream)} tokens, fewer than one sequence of seq_len={seq_len}")
    chunks = (stream[i * seq_len : (i + 1) * seq_len] for i in range(count))
    return [Example(chunk, list(chunk)) for chunk in chunks]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
