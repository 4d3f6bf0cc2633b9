"""A tiny random Llama with a word-level tokenizer over a data set's words, written where a smoke-test config points
(``model.tiny_if_missing``): the recipes then run end to end in seconds, with nothing to download."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "word_level_tokenizer", "write_tiny_model"]

# ChatML without generation markers, like SmolLM2's: the recipes compute the assistant-only loss mask themselves.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def word_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``texts`` with ChatML special tokens and a chat template."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=_SPECIAL_TOKENS))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>", bos_token=None
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_tiny_model(directory: str | Path, data_path: str | Path, *, seed: int = 0) -> Path:
    """Write a random 2-layer Llama (hidden size 64) and its tokenizer to ``directory`` with ``save_pretrained``; the
    vocabulary is the words of ``data_path`` (JSONL records or text files), so every token of the data is known."""
    directory = Path(directory)
    tokenizer = word_level_tokenizer(["system user assistant", *_strings(Path(data_path))])
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _strings(path: Path) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        for line in file.read_text().splitlines():
            try:
                yield from _strings_in(json.loads(line))
            except json.JSONDecodeError:
                yield line


def _strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_in(item)
