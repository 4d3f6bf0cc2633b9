"""The recipes under pipeline parallelism (``layout.pp_size``): SFT on 2 and 4 CPU ranks trains as without PP,
resumes bitwise, reshards between PP2 x FSDP2 and FSDP2, exports the checkpoint a run without PP exports, and runs
with packing, the fused loss and a validation set; the log shows the schedule and the measured bubble."""

from __future__ import annotations

import pytest

from automodel.training.config import ConfigError, check_world_size, load_config
from tests.cases.training import CHAT_DATA, REPO, exports_differ, save_tiny_chat_checkpoint, train, train_and_report

pytestmark = pytest.mark.distributed

# Layouts compute in different orders (a pipeline's microbatches, FSDP's reductions): fp32 rounding apart.
LAYOUT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_pp"))


def _config(tmp_path, checkpoint, recipe: str = "sft") -> str:
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(
        f"""
recipe: {recipe}
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}}}
train: {{max_steps: 8, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, lr: 3.0e-3, warmup_steps: 2,
        min_lr: 3.0e-4}}
"""
    )
    return str(path)


def _close(first: list[float], second: list[float]) -> float:
    assert len(first) == len(second), (first, second)
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


def test_sft_under_pp2_trains_as_without_pp_resumes_bitwise_and_exports_the_same_checkpoint(
    ranks2, chat_checkpoint, tmp_path
):
    config = _config(tmp_path, chat_checkpoint)
    plain = ranks2.run(train, config, [f"export.dir={tmp_path / 'plain'}"])[0]
    pipelined = ranks2.run(train_and_report, config, ["layout.pp_size=2", f"export.dir={tmp_path / 'pp'}"])[0]
    assert _close(pipelined["losses"], plain["losses"]) < LAYOUT_TOLERANCE, (pipelined["losses"], plain["losses"])
    assert pipelined["losses"][-1] < 0.9 * pipelined["losses"][0], pipelined["losses"]
    assert any("pipeline: 1f1b over 2 stages" in line and "4 microbatches" in line for line in pipelined["log"])
    steps = [line for line in pipelined["log"] if line.startswith("step ") and "tokens/s" in line]
    assert len(steps) == 8 and all("| bubble " in line for line in steps), steps[:2]
    assert exports_differ(str(tmp_path / "plain"), str(tmp_path / "pp")) < LAYOUT_TOLERANCE

    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "layout.pp_size=2"]
    first = ranks2.run(train, config, [*checkpoints, "train.stop_after_steps=4"])[0]
    assert first["losses"] == pipelined["losses"][:4]
    resumed = ranks2.run(train, config, checkpoints)[0]
    assert resumed["resumed_from"] == 4
    assert resumed["losses"] == pipelined["losses"], (
        "steps 5..8 after resuming must equal the uninterrupted run bitwise"
    )


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [(["layout.pp_size=2"], []), ([], ["layout.pp_size=2"])],
    ids=["pp2xfsdp2-to-fsdp2", "fsdp2-to-pp2xfsdp2"],
)
def test_a_checkpoint_reshards_between_pp2_x_fsdp2_and_fsdp2_on_4_ranks(
    ranks4, chat_checkpoint, tmp_path, saved, resumed
):
    config = _config(tmp_path, chat_checkpoint)
    full = ranks4.run(train, config, saved)[0]["losses"]
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    ranks4.run(train, config, [*saved, checkpoints, "train.stop_after_steps=4"])
    continued = ranks4.run(train, config, [*resumed, checkpoints])[0]
    assert continued["resumed_from"] == 4
    assert continued["losses"][:4] == full[:4]
    assert _close(continued["losses"][4:], full[4:]) < LAYOUT_TOLERANCE, (continued["losses"], full)


def test_packing_the_fused_loss_and_validation_under_pp2(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint)
    overrides = [
        "data.packing=true",
        "train.loss=fused",
        "train.loss_chunk_size=16",
        f"data.validation_path={CHAT_DATA}",
        "train.max_steps=4",
    ]
    plain = ranks2.run(train_and_report, config, overrides)[0]
    pipelined = ranks2.run(train_and_report, config, [*overrides, "layout.pp_size=2", "train.pp_microbatches=2"])[0]
    assert _close(pipelined["losses"], plain["losses"]) < LAYOUT_TOLERANCE, (pipelined["losses"], plain["losses"])
    assert abs(pipelined["eval_losses"][4] - plain["eval_losses"][4]) < LAYOUT_TOLERANCE
    assert any("pipeline: 1f1b over 2 stages" in line and "2 microbatches" in line for line in pipelined["log"])


def test_lora_under_pp2_trains_as_without_pp_and_exports_the_same_adapter(ranks2, chat_checkpoint, tmp_path):
    """lora.rank with layout.pp_size=2: the losses of the run without PP, and export.lora=adapter writes peft's files
    with the adapter that run writes (each stage's factors reach rank 0 from their stage). The merged export under PP
    (each stage folds its own adapters) is the one the same command without PP writes from the final checkpoint."""
    from safetensors.torch import load_file

    config = _config(tmp_path, chat_checkpoint)
    lora = ["lora.rank=8", "lora.target_modules=[q_proj, v_proj]", "export.lora=adapter", "train.max_steps=4"]
    plain = ranks2.run(train, config, [*lora, f"export.dir={tmp_path / 'plain'}"])[0]
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    pipelined = ranks2.run(train, config, [*lora, "layout.pp_size=2", f"export.dir={tmp_path / 'pp'}", checkpoints])[0]
    assert _close(pipelined["losses"], plain["losses"]) < LAYOUT_TOLERANCE, (pipelined["losses"], plain["losses"])
    ours, theirs = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("pp", "plain"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 8, sorted(ours)
    assert max((ours[key] - theirs[key]).abs().max().item() for key in ours) < LAYOUT_TOLERANCE
    assert (tmp_path / "pp" / "adapter_config.json").is_file()
    merged = ranks2.run(train, config, [*lora, "export.lora=merged", f"export.dir={tmp_path / 'merged'}", checkpoints])
    assert merged[0]["resumed_from"] == 4 and merged[0]["export_logits"] <= 1e-5, merged[0]
    pp_merged = [*lora, "layout.pp_size=2", "export.lora=merged", f"export.dir={tmp_path / 'pp_merged'}", checkpoints]
    assert ranks2.run(train, config, pp_merged)[0]["resumed_from"] == 4
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("pp_merged", "merged"))
    assert sorted(ours) == sorted(theirs) and all(".lora_" not in key for key in ours), sorted(ours)
    assert max((ours[key] - theirs[key]).abs().max().item() for key in ours) <= 1e-6


def test_pretraining_under_pp2_matches_it_without_pp(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint, recipe="pretrain")
    corpus = f"data.path={REPO / 'recipes' / 'data' / 'tiny_corpus.txt'}"
    overrides = [corpus, "train.max_steps=4", "train.loss=fused", "layout.pp_schedule=gpipe"]
    plain = ranks2.run(train, config, [corpus, "train.max_steps=4", "train.loss=fused"])[0]
    pipelined = ranks2.run(train, config, [*overrides, "layout.pp_size=2"])[0]
    assert _close(pipelined["losses"], plain["losses"]) < LAYOUT_TOLERANCE, (pipelined["losses"], plain["losses"])


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["layout.pp_size=2", "train.pp_microbatches=3"], 2, "must divide each data-parallel rank's share"),
        (["layout.pp_size=2", "train.global_batch_size=2", "train.micro_batch_size=2"], 2, "fewer than the 2"),
        (["layout.pp_size=2", "layout.strategy=ddp"], 2, "with strategy='ddp' is not supported"),
        (["layout.pp_size=2", "layout.cp_size=2"], 4, "with cp_size=2 is not supported yet"),
        (["layout.pp_size=3"], 4, "layout.pp_size=3 does not divide the 4 processes"),
        (["layout.pp_size=2", "layout.pp_schedule=interleaved_1f1b"], 2, "set pp_virtual_stages >= 2"),
    ],
)
def test_pipeline_layouts_that_cannot_run_are_refused_before_launch(tmp_path, overrides, world_size, message):
    config = load_config(_config(tmp_path, "unused"), overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_world_size(config, world_size)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.pp_microbatches=4"], "applies to pipeline parallelism"),
    ],
)
def test_pipeline_keys_that_cannot_apply_are_refused_when_the_config_is_read(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, "unused"), overrides)
