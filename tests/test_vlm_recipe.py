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
