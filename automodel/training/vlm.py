"""Vision-language fine-tuning: which auto class a checkpoint takes, chats with images rendered by the model's own
processor and chat template, the loss on assistant tokens only, and batches that carry the image tensors.

A record is a chat whose user turns may hold images by path::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "images/cat.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

Relative image paths are relative to the data file's folder. The labels are found by rendering prefixes of the chat
(the template must render a chat's prefix as a prefix of the whole): the tokens the template adds for each assistant
turn (its content and end-of-turn tokens) are labelled, everything else (the prompt, the images' placeholder tokens)
is ``-100``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from .data import IGNORE_INDEX, Example

__all__ = [
    "CAUSAL_LM",
    "IMAGE_TEXT_TO_TEXT",
    "collate_media",
    "model_kind",
    "resolve_image_paths",
    "tokenize_vlm_sft",
]

logger = logging.getLogger(__name__)

CAUSAL_LM, IMAGE_TEXT_TO_TEXT = "causal_lm", "image_text_to_text"
# Processor outputs that are not model inputs of their own (the ids become input_ids / labels; right padding needs
# no attention mask in causal training, as for text).
_TOKEN_KEYS = ("input_ids", "attention_mask")


def model_kind(path: str, kind: str, *, revision: str | None = None, trust_remote_code: bool = False) -> str:
    """``kind`` unless it is ``"auto"``; then ``"image_text_to_text"`` for a checkpoint whose config transformers'
    image-text-to-text auto class maps and that has a vision sub-config, else ``"causal_lm"``."""
    if kind != "auto":
        return kind
    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    vision = any("vision" in name for name in getattr(config, "sub_configs", {}) or {})
    return IMAGE_TEXT_TO_TEXT if vision and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING else CAUSAL_LM


def resolve_image_paths(records: list[dict], data_path: str | Path) -> list[dict]:
    """The records with every relative image ``path`` made relative to the data file's folder (or the data
    folder)."""
    data_path = Path(data_path)
    folder = data_path if data_path.is_dir() else data_path.parent
    resolved = []
    for record in records:
        messages = []
        for message in record.get("messages", []):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = [_resolved_part(part, folder) for part in content]
                message = {**message, "content": content}
            messages.append(message)
        resolved.append({**record, "messages": messages})
    return resolved


def _resolved_part(part: Any, folder: Path) -> Any:
    if isinstance(part, dict) and part.get("type") == "image" and isinstance(part.get("path"), str):
        path = Path(part["path"])
        return {**part, "path": str(path if path.is_absolute() else folder / path)}
    return part


def tokenize_vlm_sft(records: list[dict], processor: Any, seq_len: int) -> list[Example]:
    """Render each chat record with ``processor`` (its chat template, its image processor) into an example whose
    labels are the assistant turns' tokens; its image tensors travel in ``Example.media``.

    Raises when a chat is longer than ``seq_len`` (cutting it could cut an image's placeholders), when the template
    does not render a chat's prefix as a prefix of the whole, and when only some examples hold images (a rank whose
    micro batch has none would skip the vision tower's collectives).
    """
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(f"{type(processor).__name__} has no chat template, so the chat records cannot be rendered.")
    if not records:
        raise ValueError("No SFT records to tokenize: the data path holds no records")
    placeholders = _placeholder_ids(processor)
    examples = [
        _example(processor, _chat(record, index), index, seq_len, placeholders) for index, record in enumerate(records)
    ]
    with_images = sum(example.media is not None for example in examples)
    if 0 < with_images < len(examples):
        raise ValueError(
            f"{with_images} of {len(examples)} SFT records hold images and the others none. Every record of a "
            "vision-language run must hold at least one image: a data-parallel rank whose micro batch has none skips "
            "the vision tower, whose sharded blocks gather their weights collectively with the other ranks."
        )
    return examples


def _chat(record: dict, index: int) -> list[dict]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"SFT record {index} has keys {sorted(record)}; a vision-language record is a chat "
            "{'messages': [{'role', 'content': [{'type': 'image', 'path': ...}, {'type': 'text', 'text': ...}]}, ...]}"
        )
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or not isinstance(message.get("content"), str | list):
            raise ValueError(f"SFT record {index}, message {turn}: expected {{'role', 'content'}}, got {message!r}")
        if message["role"] == "assistant" and _has_image(message):
            raise ValueError(f"SFT record {index}, message {turn}: assistant turns hold text only, not images.")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"SFT record {index} has no assistant turn to learn from.")
    return messages


def _has_image(message: dict) -> bool:
    content = message["content"]
    return isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "image" for part in content)


def _render(processor: Any, messages: list[dict], *, prompt: bool = False) -> dict[str, Any]:
    return processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=prompt
    )


def _example(processor: Any, messages: list[dict], index: int, seq_len: int, placeholders: set[int]) -> Example:
    rendered = _render(processor, messages)
    input_ids = rendered["input_ids"][0].tolist()
    if len(input_ids) > seq_len:
        raise ValueError(
            f"SFT record {index} renders to {len(input_ids)} tokens > train.seq_len={seq_len}; a vision-language chat "
            "is not truncated (that could cut an image's placeholder tokens): raise train.seq_len."
        )
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_length(processor, messages[:turn], input_ids, index, prompt=True)
        end = _prefix_length(processor, messages[: turn + 1], input_ids, index, prompt=False)
        labels[start:end] = input_ids[start:end]
    labels = [IGNORE_INDEX if token in placeholders else label for token, label in zip(input_ids, labels, strict=True)]
    media, token_inputs = {}, {}
    for key, value in rendered.items():
        if key in _TOKEN_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.shape[:2] == (1, len(input_ids)) and value.ndim == 2:
            token_inputs[key] = value[0].tolist()
        else:
            media[key] = value
    return Example(input_ids, labels, media=media or None, token_inputs=token_inputs or None)


def _prefix_length(processor: Any, messages: list[dict], input_ids: list[int], index: int, *, prompt: bool) -> int:
    ids = _render(processor, messages, prompt=prompt)["input_ids"][0].tolist() if messages else []
    if ids != input_ids[: len(ids)]:
        raise ValueError(
            f"SFT record {index}: the chat template renders the chat's first {len(messages)} messages as something "
            "other than the beginning of the whole chat, so the assistant tokens cannot be located; use a template "
            "whose rendering of a prefix of the messages is a prefix of the rendering."
        )
    return len(ids)


def _placeholder_ids(processor: Any) -> set[int]:
    """The ids of the processor's image / video placeholder tokens (never labels)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = set()
    for name in ("image_token", "video_token"):
        token = getattr(processor, name, None)
        if isinstance(token, str):
            ids.add(tokenizer.convert_tokens_to_ids(token))
    for name in ("image_token_id", "video_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    return ids


def collate_media(examples: list[Example], seq_len: int) -> dict[str, torch.Tensor]:
    """The examples' image tensors concatenated along their first dimension (images without a batch dimension, such
    as Qwen-VL's patches, line up the same way) and their per-token inputs right-padded with 0 to ``seq_len``."""
    batch: dict[str, torch.Tensor] = {}
    with_media = [example.media for example in examples if example.media is not None]
    for key in with_media[0] if with_media else ():
        tensors = [media[key] for media in with_media]
        if len({tensor.shape[1:] for tensor in tensors}) > 1:
            raise ValueError(
                f"The micro batch's {key} tensors have different shapes {[tuple(t.shape) for t in tensors]}; give "
                "every record the same number of images, or use train.micro_batch_size=1."
            )
        batch[key] = torch.cat(tensors)
    keys = {key for example in examples for key in example.token_inputs or {}}
    for key in sorted(keys):
        padded = torch.zeros((len(examples), seq_len), dtype=torch.long)
        for row, example in enumerate(examples):
            values = (example.token_inputs or {}).get(key, [])
            padded[row, : len(values)] = torch.tensor(values, dtype=torch.long)
        batch[key] = padded
    return batch
