"""The SFT and pretraining recipes on 2 CPU ranks: the loss falls, a resumed run continues bitwise, a checkpoint
reshards onto another layout, a crash mid-save leaves the previous checkpoint usable, and the export loads in plain
transformers with the trained model's logits."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import ModelCard

from automodel.distributed import FSDP2Config
from tests.cases.loss import grad_sync_parity
from tests.cases.training import (
    CHAT_DATA,
    REPO,
    grad_norm_matches_plain,
    resume_error,
    save_tiny_chat_checkpoint,
    train,
    train_and_report,
    train_lora,
    train_with_a_crash_during_save,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return save_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


def _config(tmp_path, checkpoint, recipe: str = "sft", data=CHAT_DATA) -> str:
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(
        f"""
recipe: {recipe}
model: {{path: {checkpoint}}}
data: {{path: {data}}}
train: {{max_steps: 30, global_batch_size: 8, micro_batch_size: 2, seq_len: 48, lr: 3.0e-3, warmup_steps: 3,
        min_lr: 3.0e-4}}
"""
    )
    return str(path)


def test_sft_loss_falls_and_a_resumed_run_continues_bitwise(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint)
    full = ranks2.run(train, config, [])[0]["losses"]
    assert len(full) == 30 and full[-1] < 0.75 * full[0], full
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    first = ranks2.run(train, config, [checkpoints, "checkpoint.every_steps=5", "train.stop_after_steps=10"])[0]
    assert first["losses"] == full[:10]
    export = tmp_path / "export"
    resumed = ranks2.run(train, config, [checkpoints, "checkpoint.every_steps=5", f"export.dir={export}"])[0]
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == full, "steps 11..30 after resuming must equal the uninterrupted run bitwise"
    # The export loads in plain transformers with the trained sharded model's logits, and its card parses.
    assert resumed["export_logits"] <= 1e-5, resumed["export_logits"]
    card = ModelCard.load(export / "README.md")
    assert card.data.library_name == "transformers" and "sft" in card.data.tags


def test_a_checkpoint_resumes_on_another_layout(ranks2, chat_checkpoint, tmp_path):
    """Saved with FSDP2 over 2 ranks, resumed with TP=2: the sharded state is re-split by DCP and training continues
    from the same loss."""
    config = _config(tmp_path, chat_checkpoint)
    full = ranks2.run(train, config, [])[0]["losses"]
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    ranks2.run(train, config, [checkpoints, "train.stop_after_steps=10"])
    resumed = ranks2.run(train, config, [checkpoints, "layout.tp_size=2", "train.stop_after_steps=5"])[0]
    assert resumed["resumed_from"] == 10 and len(resumed["losses"]) == 15
    assert resumed["losses"][:10] == full[:10]
    assert max(abs(a - b) for a, b in zip(resumed["losses"][10:], full[10:15], strict=True)) < 1e-4, resumed["losses"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint)
    full = ranks2.run(train, config, [])[0]["losses"]
    overrides = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=5"]
    crashed = ranks2.run(train_with_a_crash_during_save, config, overrides, 10)[0]
    assert crashed["error"] == "killed while writing a checkpoint"
    assert crashed["entries"] == ["LATEST", "step_00000005", "step_00000010.partial"], crashed
    assert crashed["latest"] == "step_00000005" and crashed["pointer"] == "step_00000005"
    resumed = ranks2.run(train, config, overrides)[0]
    assert resumed["resumed_from"] == 5 and resumed["losses"] == full


def test_asynchronous_checkpoints_resume_bitwise_and_a_failed_one_is_never_latest(ranks2, chat_checkpoint, tmp_path):
    """checkpoint.async=true: training goes on while a checkpoint is written; it is committed only once written on
    every rank, so a save that dies in the background leaves the previous one LATEST, and the resume is bitwise."""
    config = _config(tmp_path, chat_checkpoint)
    full = ranks2.run(train, config, [])[0]["losses"]
    overrides = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=5", "checkpoint.async=true"]
    first = ranks2.run(train, config, [*overrides, "train.stop_after_steps=12"])[0]
    assert first["losses"] == full[:12]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["LATEST", "step_00000010", "step_00000012"]
    resumed = ranks2.run(train, config, overrides)[0]
    assert resumed["resumed_from"] == 12 and resumed["losses"] == full
    overrides[0] = f"checkpoint.dir={tmp_path / 'crashed'}"
    crashed = ranks2.run(train_with_a_crash_during_save, config, overrides, 10)[0]
    assert crashed["error"] == "killed while writing a checkpoint"
    assert crashed["entries"] == ["LATEST", "step_00000005", "step_00000010.partial"], crashed
    assert crashed["latest"] == "step_00000005" and crashed["pointer"] == "step_00000005"
    resumed = ranks2.run(train, config, overrides)[0]
    assert resumed["resumed_from"] == 5 and resumed["losses"] == full


def test_pretraining_from_config_on_packed_text_falls_and_resumes(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint, recipe="pretrain", data=REPO / "recipes" / "data" / "tiny_corpus.txt")
    full = ranks2.run(train, config, [])[0]["losses"]
    assert full[-1] < 0.75 * full[0], full
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    ranks2.run(train, config, [checkpoints, "train.stop_after_steps=10"])
    assert ranks2.run(train, config, [checkpoints])[0]["losses"] == full


def test_sft_with_lora_trains_only_the_adapters_and_exports_them_merged(ranks2, chat_checkpoint, tmp_path):
    """export.lora=both: the merged checkpoint in export.dir, the adapter alone in export.dir/adapter."""
    config = _config(tmp_path, chat_checkpoint)
    export = tmp_path / "export"
    result = ranks2.run(
        train_lora,
        config,
        ["lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj, v_proj, up_proj, down_proj]", "train.lr=3e-2"]
        + [f"export.dir={export}", "export.lora=both"],
    )[0]
    assert result["adapter_logits"] <= 1e-5, result["adapter_logits"]
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".export")], "no staging left"
    losses = result["losses"]
    # Rank-8 adapters on a random tiny model fit less than full training (which falls below 0.75x).
    assert losses[-1] < losses[0] - 0.3 and sum(losses[-5:]) < sum(losses[:5]) - 1.5, losses
    assert result["export_logits"] <= 1e-5, result["export_logits"]
    # Only the projections the adapters wrap moved (their merged weights); everything else is the checkpoint's.
    assert result["changed_weights"] and all(
        name.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight", "down_proj.weight"))
        for name in result["changed_weights"]
    ), result["changed_weights"]


def test_sft_with_lora_under_tp_resumes_bitwise_and_exports_an_adapter_peft_loads(ranks2, chat_checkpoint, tmp_path):
    """lora.rank=8 with layout.tp_size=2 on 2 ranks: the loss falls, a resumed run continues bitwise, and the
    adapter-only export loads with peft onto plain transformers with the trained model's logits."""
    config = _config(tmp_path, chat_checkpoint)
    lora = ["lora.rank=8", "lora.alpha=16", "lora.target_modules=[q_proj, v_proj, up_proj, down_proj]", "train.lr=3e-2"]
    layout = ["layout.tp_size=2", "export.lora=adapter", f"export.dir={tmp_path / 'adapter'}"]
    full = ranks2.run(train_lora, config, lora + layout)[0]
    losses = full["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert full["adapter_logits"] <= 1e-5, full["adapter_logits"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(full["adapter_files"])
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}"]
    ranks2.run(train, config, lora + layout + checkpoints + ["train.stop_after_steps=10"])
    assert ranks2.run(train, config, lora + layout + checkpoints)[0]["losses"] == losses


@pytest.mark.parametrize(
    ("world", "layout"),
    [(4, {"strategy": "fsdp2", "tp_size": 2}), (4, {"strategy": "fsdp2", "dp_replicate_size": 2})],
    ids=["fsdp2_x_tp2", "hsdp"],
)
def test_gradient_clipping_uses_the_global_norm_of_sharded_gradients(request, world, layout):
    for result in request.getfixturevalue(f"ranks{world}").run(grad_norm_matches_plain, layout):
        assert abs(result["norm"] - result["expected"]) <= 1e-5 * result["expected"], result
        assert result["clipped"] <= 1e-6, result


def test_bf16_mixed_precision_and_activation_checkpointing_from_the_config(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint)
    full = ranks2.run(train, config, ["train.max_steps=10"])[0]["losses"]
    # Checkpointed blocks recompute exactly what they computed: the same losses, bitwise.
    assert (
        ranks2.run(train, config, ["train.max_steps=10", "layout.activation_checkpointing=selective"])[0]["losses"]
        == full
    )
    bf16 = ranks2.run(train, config, ["train.max_steps=10", "layout.mixed_precision=bf16"])[0]["losses"]
    assert all(abs(a - b) < 0.05 for a, b in zip(bf16, full, strict=True)) and bf16 != full, (bf16, full)


def test_a_resume_takes_the_schedule_of_its_config_and_says_where_it_resumed(ranks2, chat_checkpoint, tmp_path):
    """Trained to max_steps=6, then resumed from that final checkpoint with max_steps=12 and another warmup and lr:
    its first step uses the new schedule's learning rate at step 6, and the log names the checkpoint and layouts."""
    from automodel.training.config import TrainSection
    from automodel.training.optim import make_scheduler

    config = _config(tmp_path, chat_checkpoint)
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}"]
    ranks2.run(train, config, checkpoints + ["train.max_steps=6", "train.warmup_steps=2"])
    longer = ["train.max_steps=12", "train.warmup_steps=4", "train.lr=2e-3", "layout.tp_size=2"]
    resumed = ranks2.run(train_and_report, config, checkpoints + longer)[0]
    schedule = TrainSection(max_steps=12, warmup_steps=4, lr=2e-3, min_lr=3e-4)
    factor = make_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3), schedule).lr_lambdas[0]
    assert resumed["resumed_from"] == 6 and len(resumed["learning_rates"]) == 6
    assert resumed["learning_rates"] == pytest.approx([2e-3 * factor(step) for step in range(6, 12)], rel=1e-12)
    line = next(message for message in resumed["log"] if message.startswith("resuming from"))
    assert "step_00000006 at step 6" in line and "layout saved: fsdp2 on 2 processes," in line, line
    assert "layout now: fsdp2 on 2 processes, tp_size=2" in line, line


def test_validation_loss_tokens_per_second_and_mfu_in_the_log(ranks2, chat_checkpoint, tmp_path):
    """data.validation_path with eval_every_steps=5: the eval loss at 5 and 10; at the end it equals plain
    transformers' mean token loss of the exported model on that set. tokens/s counts tokens, MFU shows with a peak."""
    config = _config(tmp_path, chat_checkpoint)
    overrides = [
        f"data.validation_path={CHAT_DATA}",
        "train.eval_every_steps=5",
        "train.max_steps=10",
        "train.peak_tflops=0.001",
        f"export.dir={tmp_path / 'export'}",
    ]
    result = ranks2.run(train_and_report, config, overrides)[0]
    assert sorted(result["eval_losses"]) == [5, 10], result["eval_losses"]
    assert result["eval_losses"][10] == pytest.approx(result["reference_eval_loss"], abs=1e-5)
    steps = [message for message in result["log"] if message.startswith("step ") and "tokens/s" in message]
    assert len(steps) == 10 and all("| MFU " in message for message in steps), steps[:2]
    assert any(message.startswith("step 10 | eval loss") for message in result["log"])
    assert (
        "gradient accumulation: 2 micro batches per rank per step; gradients reduced once per step, after the last "
        "(unsharded gradients held through the accumulation) (train.grad_sync: step)"
    ) in result["log"]


def test_a_validation_pass_leaves_the_training_steps_after_it_unchanged(ranks2, chat_checkpoint, tmp_path):
    """An evaluation (or the packed-attention check before training) runs FSDP2 units forward without a backward:
    the units that keep their full weights after forward must be resharded after it, or the next step's gradients
    of those weights differ (they did: step 2 of a packed run differed by 3e-2)."""
    config = _config(tmp_path, chat_checkpoint)
    overrides = ["train.max_steps=6", "data.packing=true"]
    alone = ranks2.run(train_and_report, config, overrides)[0]
    evaluated = ranks2.run(
        train_and_report, config, [*overrides, f"data.validation_path={CHAT_DATA}", "train.eval_every_steps=2"]
    )[0]
    assert sorted(evaluated["eval_losses"]) == [2, 4, 6]
    assert evaluated["losses"] == alone["losses"]
    tensor_parallel = ranks2.run(train, config, [*overrides, "layout.tp_size=2"])[0]  # no FSDP units at all
    assert max(abs(a - b) for a, b in zip(alone["losses"], tensor_parallel["losses"], strict=True)) < 1e-4


@pytest.mark.parametrize("policy", [None, True, False], ids=["default", "always", "never"])
def test_grad_sync_per_micro_batch_gives_the_gradients_of_one_reduction_per_step(ranks2, policy):
    """train.grad_sync: micro_batch reduces after every micro batch (FSDP2 holds only sharded gradients between them)
    and computes the gradients of the default, which reduces once after the last micro batch."""
    layout = {"strategy": FSDP2Config(reshard_after_forward=policy)}
    for rank, result in enumerate(ranks2.run(grad_sync_parity, layout)):
        assert result["micro_batches"] == 2, result
        assert result["flags"] == {"step": [False, True], "micro_batch": [True, True]}, f"rank {rank}: {result}"
        assert result["loss_difference"] <= 1e-6 and result["grad"] <= 1e-6, f"rank {rank}: {result}"
        assert result["grad_norm"] > 0, result


def test_the_recipe_with_grad_sync_per_micro_batch_trains_as_the_default(ranks2, chat_checkpoint, tmp_path):
    config = _config(tmp_path, chat_checkpoint)
    overrides = ["train.max_steps=4", "train.micro_batch_size=1"]
    default = ranks2.run(train_and_report, config, overrides)[0]
    per_micro_batch = ranks2.run(train_and_report, config, [*overrides, "train.grad_sync=micro_batch"])[0]
    assert max(abs(a - b) for a, b in zip(default["losses"], per_micro_batch["losses"], strict=True)) < 1e-5
    assert (
        "gradient accumulation: 4 micro batches per rank per step; gradients reduced after every micro batch "
        "(sharded gradients only) (train.grad_sync: micro_batch)"
    ) in per_micro_batch["log"]


def test_fsdp2_reshard_policies_and_prefetch_train_bitwise_alike(ranks2, chat_checkpoint, tmp_path):
    """layout.reshard_after_forward always / all_but_last / never (ZeRO-2: also unsharded through the gradient
    accumulation) and layout.prefetch change when parameters are gathered, never what is computed."""
    config = _config(tmp_path, chat_checkpoint)
    overrides = ["train.max_steps=4", "train.micro_batch_size=1"]
    reference = ranks2.run(train, config, overrides)[0]["losses"]
    # The reference is the default: all_but_last with prefetch.
    for policy, prefetch in [
        ("all_but_last", "false"),
        *[(p, f) for p in ("always", "never") for f in ("true", "false")],
    ]:
        layout = [f"layout.reshard_after_forward={policy}", f"layout.prefetch={prefetch}"]
        assert ranks2.run(train, config, overrides + layout)[0]["losses"] == reference, (policy, prefetch)


def test_a_checkpoint_past_max_steps_or_damaged_is_refused_with_the_way_on(ranks2, chat_checkpoint, tmp_path):
    """A checkpoint at step 4 with train.max_steps=2 would train nothing and export 4 steps under a card saying 2; a
    newest checkpoint whose files were damaged after it was written names the one before it."""
    config = _config(tmp_path, chat_checkpoint)
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=2", "checkpoint.keep=3"]
    ranks2.run(train, config, [*checkpoints, "train.max_steps=4"])
    messages = ranks2.run(resume_error, config, [*checkpoints, "train.max_steps=2", "train.warmup_steps=1"])
    assert len(set(messages)) == 1 and "is at step 4, past train.max_steps=2" in messages[0], messages
    (tmp_path / "ckpt" / "step_00000004" / "trainer_state.pt").unlink()
    messages = ranks2.run(resume_error, config, [*checkpoints, "train.max_steps=6"])
    assert len(set(messages)) == 1, messages
    assert "step_00000004 cannot be read (FileNotFoundError" in messages[0], messages
    assert f"move it out of {tmp_path / 'ckpt'} to resume from step_00000002" in messages[0], messages
