"""The checkpoint-robustness matrix, on 4 CPU ranks, for the model families whose resume peers see break (dense,
tied embeddings, MoE under EP, Mamba hybrids, linear attention, LoRA):

(a) 3 steps, save, resume: steps 4-6 equal the uninterrupted run bitwise;
(b) the same checkpoint resumed under another layout (a changed TP / HSDP / EP degree, and with it the data-parallel
    size) continues within 1e-4;
(c) the export loads in plain transformers with the sharded model's logits;
(d) the export reloaded by ``from_pretrained`` under another layout gives the same logits.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import pytest

from tests.cases.training import CHAT_DATA, reloaded_export_logits, save_tiny_chat_checkpoint, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
SAVED = 3
LORA = ["lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj, v_proj, up_proj, down_proj]"]
TP2 = ("tp2", ["layout.tp_size=2"], {"strategy": "fsdp2", "tp_size": 2})
HSDP = ("hsdp", ["layout.dp_replicate_size=2"], {"strategy": "fsdp2", "dp_replicate_size": 2})
EP4 = ("ep4", ["layout.ep_size=4"], {"strategy": "fsdp2", "ep_size": 4})


@dataclass(frozen=True)
class Family:
    """A model family of the matrix: its tiny architecture, the layout it trains on, the layouts it resumes on."""

    architecture: str
    others: tuple[tuple[str, list[str], dict], ...]
    layout: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)


FAMILIES = {
    "llama": Family("llama", (TP2, HSDP)),
    "llama_tied": Family("llama_tied", (TP2, HSDP)),
    "qwen3_moe_ep2": Family("qwen3_moe", (EP4,), layout=["layout.ep_size=2"]),
    "nemotron_h": Family("nemotron_h", (TP2, HSDP)),
    "qwen3_5": Family("qwen3_5", (TP2,)),
    "llama_lora": Family("llama", (TP2, HSDP), extra=LORA),
}


def _config(tmp_path, checkpoint) -> str:
    path = tmp_path / "sft.yaml"
    path.write_text(
        f"""
recipe: sft
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}}}
train: {{max_steps: {STEPS}, global_batch_size: 8, micro_batch_size: 2, seq_len: 32, lr: 3.0e-3, warmup_steps: 2,
        min_lr: 3.0e-4}}
"""
    )
    return str(path)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_resume_reshard_and_export(ranks4, tmp_path, name):
    family = FAMILIES[name]
    checkpoint = save_tiny_chat_checkpoint(tmp_path / "model", architecture=family.architecture)
    config = _config(tmp_path, checkpoint)
    options = family.layout + family.extra
    full = ranks4.run(train, config, options)[0]["losses"]
    assert len(full) == STEPS and len(set(full)) == STEPS, full

    saved = tmp_path / "saved"
    first = ranks4.run(train, config, [*options, f"checkpoint.dir={saved}", f"train.stop_after_steps={SAVED}"])[0]
    assert first["losses"] == full[:SAVED]
    for other, _, _ in family.others:
        shutil.copytree(saved, tmp_path / f"saved_for_{other}")

    # (a) bitwise resume on the same layout, and (c) its export in plain transformers.
    export = tmp_path / "export"
    resumed = ranks4.run(train, config, [*options, f"checkpoint.dir={saved}", f"export.dir={export}"])[0]
    assert resumed["resumed_from"] == SAVED
    assert resumed["losses"] == full, f"steps {SAVED + 1}..{STEPS} after resuming must equal the uninterrupted run"
    assert resumed["export_logits"] <= 1e-5, resumed["export_logits"]

    for other, overrides, layout in family.others:
        # (b) the same checkpoint resumed under another layout (and another data-parallel size).
        moved = [*family.extra, *overrides, f"checkpoint.dir={tmp_path / f'saved_for_{other}'}"]
        continued = ranks4.run(train, config, moved)[0]
        assert continued["resumed_from"] == SAVED
        assert continued["losses"][:SAVED] == full[:SAVED]
        drift = max(abs(a - b) for a, b in zip(continued["losses"][SAVED:], full[SAVED:], strict=True))
        assert drift <= 1e-4, (other, continued["losses"], full)
        # (d) the export reloaded under that layout.
        difference = ranks4.run(reloaded_export_logits, str(export), layout)[0]
        assert difference <= 1e-5, (other, difference)
