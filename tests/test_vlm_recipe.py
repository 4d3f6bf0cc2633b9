"""``automodel sft`` on a tiny vision-language model (LLaVA) on 2 CPU ranks: chats whose user turns hold images by
path, rendered by the model's own processor; the loss falls, a resumed run continues bitwise, and the export (weights
and processor) loads in plain transformers with the trained model's logits."""

from __future__ import annotations

import pytest

from tests.cases.vlm import train_vlm
from tests.vlm_models import save_tiny_llava_with_processor, write_image_chat_set

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm_recipe")
    save_tiny_llava_with_processor(folder / "tiny_llava")
    data = write_image_chat_set(folder / "data")
    config = folder / "sft_vlm.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {folder / "tiny_llava"}}}
data: {{path: {data}}}
train: {{max_steps: 16, global_batch_size: 4, micro_batch_size: 2, seq_len: 32, lr: 1.0e-2, warmup_steps: 2,
        min_lr: 1.0e-3}}
"""
    )
    return folder


def test_vlm_sft_loss_falls_resumes_bitwise_and_exports_with_its_processor(ranks2, project, tmp_path):
    config = str(project / "sft_vlm.yaml")
    full = ranks2.run(train_vlm, config, [])[0]["losses"]
    assert len(full) == 16 and full[-1] < 0.5 * full[0], full
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=3"]
    first = ranks2.run(train_vlm, config, [*checkpoints, "train.stop_after_steps=8"])[0]
    assert first["losses"] == full[:8]
    resumed = ranks2.run(train_vlm, config, [*checkpoints, f"export.dir={tmp_path / 'export'}"])
    assert resumed[0]["resumed_from"] == 8
    assert resumed[0]["losses"] == full, "steps 9..16 after resuming must equal the uninterrupted run bitwise"
    assert resumed[0]["processor"] == "LlavaProcessor", resumed[0]
    assert resumed[0]["export_logits"] <= 1e-5, resumed[0]["export_logits"]
    assert {"processor_config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "export").iterdir()}


def test_packing_is_refused_for_a_vision_language_model(ranks2, project):
    from tests.harness import RankFailure

    with pytest.raises(RankFailure, match="data.packing=true is not supported for vision-language models"):
        ranks2.run(train_vlm, str(project / "sft_vlm.yaml"), ["data.packing=true"])


def test_labels_are_the_assistant_turns_and_never_image_placeholders(project):
    from transformers import AutoProcessor

    from automodel.training.data import IGNORE_INDEX, load_records
    from automodel.training.vlm import resolve_image_paths, tokenize_vlm_sft

    processor = AutoProcessor.from_pretrained(project / "tiny_llava")
    data = project / "data" / "chats.jsonl"
    records = load_records(data)
    examples = tokenize_vlm_sft(resolve_image_paths(records, data), processor, seq_len=32)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    for record, example in zip(records, examples, strict=True):
        labelled = [token for token, label in zip(example.input_ids, example.labels, strict=True) if label != -100]
        answer = record["messages"][1]["content"][0]["text"]
        assert processor.tokenizer.decode(labelled) == f"{answer} <|end|>"
        assert example.input_ids.count(image_token) == 16, "16 patches of the 16x16 image"
        assert all(
            label == IGNORE_INDEX
            for token, label in zip(example.input_ids, example.labels, strict=True)
            if token == image_token
        )
        assert tuple(example.media["pixel_values"].shape) == (1, 3, 16, 16)


def test_images_only_in_some_records_are_refused(project, tmp_path):
    from transformers import AutoProcessor

    from automodel.training.vlm import tokenize_vlm_sft

    processor = AutoProcessor.from_pretrained(project / "tiny_llava")
    image = str(project / "data" / "images" / "0.png")
    with_image = [{"type": "image", "path": image}, {"type": "text", "text": "what is in the picture"}]
    chats = [
        {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a red square"}]}
        for content in (with_image, "what is in the picture")
    ]
    with pytest.raises(ValueError, match="1 of 2 SFT records hold images"):
        tokenize_vlm_sft(chats, processor, seq_len=32)


def test_the_auto_class_follows_the_checkpoint(project, tmp_path):
    from automodel.training.vlm import model_kind
    from tests.tiny_models import build_model, tiny_llama_config

    build_model(tiny_llama_config()).save_pretrained(tmp_path)
    assert model_kind(str(project / "tiny_llava"), "auto") == "image_text_to_text"
    assert model_kind(str(tmp_path), "auto") == "causal_lm"
    assert model_kind(str(tmp_path), "image_text_to_text") == "image_text_to_text"


def test_batches_concatenate_image_patches_and_grids_without_a_batch_dimension():
    """Qwen2.5-VL's flattened patches and its grid / per-token tensors batch through the loader's collation: the
    padded batch gives the model the same logits as the examples stacked by hand."""
    import torch

    from automodel.training.batches import DistributedBatchLoader
    from automodel.training.data import Example
    from tests.vlm_models import build_vlm, collate, tiny_vlm_config, vlm_examples

    config = tiny_vlm_config("qwen2_5_vl")
    examples = vlm_examples(config, count=4)
    token_keys = ("mm_token_type_ids",)
    converted = [
        Example(
            example["input_ids"][0].tolist(),
            example["labels"][0].tolist(),
            media={key: example[key] for key in ("pixel_values", "image_grid_thw")},
            token_inputs={key: example[key][0].tolist() for key in token_keys},
        )
        for example in examples
    ]
    loader = DistributedBatchLoader(
        converted, global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1, seq_len=12, pad_id=0
    )
    (batch,) = loader.next_global_batch()
    assert tuple(batch["pixel_values"].shape) == (64, 96) and tuple(batch["image_grid_thw"].shape) == (4, 3)
    assert tuple(batch["mm_token_type_ids"].shape) == (4, 12)
    model = build_vlm(config).eval()
    order = [ids.tolist() for ids in batch["input_ids"][:, :10]]
    stacked = collate(sorted(examples, key=lambda example: order.index(example["input_ids"][0].tolist())))
    batch.pop("num_tokens")
    with torch.no_grad():
        padded = model(**batch).logits[:, :10]
        plain = model(**stacked).logits
    assert (padded - plain).abs().max().item() <= 1e-5


def test_a_declared_vision_language_run_refuses_packing_and_pretraining_in_the_config(project):
    from automodel.training.config import ConfigError, load_config

    config = str(project / "sft_vlm.yaml")
    with pytest.raises(ConfigError, match="data.packing=true is not supported for vision-language models"):
        load_config(config, ["model.kind=image_text_to_text", "data.packing=true"])
    with pytest.raises(ConfigError, match="the pretrain recipe trains text models only"):
        load_config(config, ["model.kind=image_text_to_text", "recipe=pretrain"])
    assert load_config(config, ["model.kind=causal_lm"]).model.kind == "causal_lm"


def test_the_fused_loss_trains_a_vision_language_model_as_the_model_loss_does(ranks2, project):
    """train.loss=fused on a VLM: the head's input is the decoder's output, as on text models; the same losses."""
    config = str(project / "sft_vlm.yaml")
    plain = ranks2.run(train_vlm, config, ["train.max_steps=4"])[0]["losses"]
    fused = ranks2.run(train_vlm, config, ["train.max_steps=4", "train.loss=fused", "train.loss_chunk_size=16"])
    assert max(abs(a - b) for a, b in zip(fused[0]["losses"], plain, strict=True)) <= 1e-5, (fused, plain)
