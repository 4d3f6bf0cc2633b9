"""Tiny random vision-language models of transformers 5.24 and image + text batches for them.

Each architecture has a two-layer language decoder (4 query heads, 2 KV heads: TP=2 divides both) and a two-block
vision encoder over 16x16 images. A batch is a list of examples (one image each, the image's placeholder tokens after
two text tokens); :func:`collate` stacks any subset of them, so a data-parallel rank takes its own examples whole,
whatever the layout of their pixel tensors (Qwen-VL's flattened patches have no batch dimension).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PretrainedConfig

VOCAB = 128
IMAGE_TOKEN, VIDEO_TOKEN, START_TOKEN, END_TOKEN = 120, 121, 122, 123
#: Text tokens are drawn below this id (the special ids above it never occur as text).
TEXT_VOCAB = 110

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_QWEN_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4, spatial_merge_size=2
)
_QWEN_TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=START_TOKEN)

#: Tiny configs (model type, keyword arguments) of the tested vision-language architectures.
VLM_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llava": (
        "llava",
        dict(
            text_config=dict(model_type="llama", **_TEXT),
            vision_config=dict(
                model_type="clip_vision_model", image_size=16, patch_size=4, projection_dim=32, **_VISION
            ),
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-1,
        ),
    ),
    "mistral3": (
        "mistral3",
        dict(
            text_config=dict(model_type="mistral", **_TEXT, head_dim=8),
            vision_config=dict(model_type="pixtral", image_size=16, patch_size=4, head_dim=8, **_VISION),
            image_token_index=IMAGE_TOKEN,
            spatial_merge_size=2,
            vision_feature_layer=-1,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(
            text_config=dict(model_type="gemma3_text", **_TEXT, head_dim=8, sliding_window=4),
            vision_config=dict(
                model_type="siglip_vision_model", image_size=16, patch_size=4, vision_use_head=False, **_VISION
            ),
            mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN,
            boi_token_index=START_TOKEN,
            eoi_token_index=END_TOKEN,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_5_vl": (
        "qwen2_5_vl",
        dict(
            text_config=dict(
                model_type="qwen2_5_vl_text",
                **_TEXT,
                rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0),
            ),
            vision_config=dict(**_QWEN_VISION, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1]),
            **_QWEN_TOKENS,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_vl": (
        "qwen3_vl",
        dict(
            text_config=dict(
                model_type="qwen3_vl_text",
                **_TEXT,
                head_dim=8,
                rope_parameters=dict(
                    rope_type="default", mrope_section=[1, 1, 2], mrope_interleaved=True, rope_theta=10000.0
                ),
            ),
            vision_config=dict(
                **_QWEN_VISION, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[1]
            ),
            **_QWEN_TOKENS,
            tie_word_embeddings=False,
        ),
    ),
    "idefics3": (
        "idefics3",
        dict(
            text_config=dict(model_type="llama", **_TEXT),
            vision_config=dict(image_size=16, patch_size=4, **_VISION),
            scale_factor=2,
            image_token_id=IMAGE_TOKEN,
            tie_word_embeddings=False,
        ),
    ),
    "smolvlm": (
        "smolvlm",
        dict(
            text_config=dict(model_type="llama", **_TEXT),
            vision_config=dict(image_size=16, patch_size=4, **_VISION),
            scale_factor=2,
            image_token_id=IMAGE_TOKEN,
            tie_word_embeddings=False,
        ),
    ),
    "internvl": (
        "internvl",
        dict(
            text_config=dict(model_type="qwen2", **_TEXT),
            vision_config=dict(image_size=16, patch_size=4, **_VISION),
            image_token_id=IMAGE_TOKEN,
            downsample_ratio=0.5,
            tie_word_embeddings=False,
        ),
    ),
}


def tiny_vlm_config(architecture: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of one tested vision-language architecture, with ``overrides``."""
    model_type, values = VLM_ARCHITECTURES[architecture]
    config = AutoConfig.for_model(model_type, **{**values, **overrides})
    config.architectures = [AutoModelForImageTextToText._model_mapping[type(config)].__name__]
    return config


def build_vlm(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The plain transformers model for ``config`` with weights drawn after ``torch.manual_seed(seed)``.

    Parameters transformers initialises to zeros get small random values too: Gemma 3's image projection starts at
    zero, and the decoder's RMS norms then see all-zero image rows, whose gradients are scaled by ``1/sqrt(eps)``
    (1e3) into values near 1e6, where fp32 rounding alone exceeds the absolute tolerance. A trained checkpoint has no
    such rows, and random values make every slice visible.
    """
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.normal_(0.0, 0.02)
    return model


def save_tiny_vlm(architecture: str, directory, *, seed: int = 0, max_shard_size: str = "40KB", **overrides: Any):
    """Save a tiny random checkpoint of ``architecture`` with ``save_pretrained`` (several shards); return it."""
    model = build_vlm(tiny_vlm_config(architecture, **overrides), seed=seed)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def _image_tensors(config: PretrainedConfig, generator: torch.Generator) -> tuple[int, dict[str, torch.Tensor]]:
    """One 16x16 image as the model takes it, and the number of placeholder tokens its features fill."""
    model_type = config.model_type
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        # 4x4 patches of 4x4 pixels over 2 frames, merged 2x2: 4 tokens.
        patches = torch.randn(16, 3 * 2 * 4 * 4, generator=generator)
        return 4, {"pixel_values": patches, "image_grid_thw": torch.tensor([[1, 4, 4]])}
    pixels = torch.randn(1, 3, 16, 16, generator=generator)
    if model_type == "llava":
        return 16, {"pixel_values": pixels}
    if model_type == "mistral3":
        return 4, {"pixel_values": pixels, "image_sizes": torch.tensor([[16, 16]])}
    if model_type in ("idefics3", "smolvlm"):
        return 4, {"pixel_values": pixels[:, None]}
    return 4, {"pixel_values": pixels}  # gemma3 (pooled to mm_tokens_per_image), internvl (pixel shuffle)


def vlm_examples(config: PretrainedConfig, count: int = 4, seed: int = 1, text_len: int = 6) -> list[dict]:
    """``count`` examples of one image and ``text_len`` random text tokens, with labels on the text only."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        image_tokens, tensors = _image_tensors(config, generator)
        text = torch.randint(0, TEXT_VOCAB, (1, text_len), generator=generator)
        ids = torch.cat([text[:, :2], torch.full((1, image_tokens), IMAGE_TOKEN), text[:, 2:]], dim=1)
        labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
        example = {"input_ids": ids, "labels": labels, **tensors}
        if config.model_type == "gemma3":
            example["token_type_ids"] = (ids == IMAGE_TOKEN).long()
        if config.model_type in ("qwen2_5_vl", "qwen3_vl"):
            example["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
        examples.append(example)
    return examples


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    """The examples as one batch: every tensor concatenated along its first dimension."""
    return {key: torch.cat([example[key] for example in examples]) for key in examples[0]}


# ------------------------------------------------------------------------------------------------ recipe checkpoint

#: The words of the generated chat set (``write_image_chat_set``); the tiny tokenizer knows exactly these.
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 220)}
_WORDS = ["what", "is", "in", "the", "picture", "a", "square", "it", "shows", *COLOURS]
_SPECIAL = ["<unk>", "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<image>"]
#: A template without generation markers: the recipe finds the assistant tokens itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ '<image>' }}{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% endif %}"
)


def save_tiny_llava_with_processor(directory, seed: int = 0):
    """A tiny random LLaVA and its processor (a word-level tokenizer with a chat template, and CLIP's image
    processor at 16x16 pixels), saved for ``from_pretrained`` / ``AutoProcessor``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(_SPECIAL + _WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<image>"],
    )
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=CHAT_TEMPLATE,
    )
    model_type, values = VLM_ARCHITECTURES["llava"]
    text = dict(values["text_config"], pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = tiny_vlm_config(
        "llava",
        text_config=dict(text, bos_token_id=None),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    build_vlm(config, seed=seed).save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def write_image_chat_set(folder, count: int = 16, seed: int = 0):
    """``count`` chats asking what a generated 20x20 image shows (a coloured square, written as PNG beside the data,
    referenced by relative path) and answering its colour; returns the JSONL file."""
    import json
    from pathlib import Path

    import numpy as np
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = sorted(COLOURS)
    lines = []
    for index in range(count):
        colour = names[index % len(names)]
        pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 12, (20, 20, 3)), 0, 255).astype("uint8")
        Image.fromarray(pixels).save(folder / "images" / f"{index}.png")
        user = [{"type": "image", "path": f"images/{index}.png"}, {"type": "text", "text": "what is in the picture"}]
        answer = [{"type": "text", "text": f"a {colour} square"}]
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
        )
    path = folder / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
