"""TensorBoard, Weights & Biases (offline) and MLflow (a local file store) receive the same scalars at the same steps
from a recipe run on 2 CPU ranks (``automodel.training.trackers``)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.cases.trackers import train_with_trackers
from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint

pytestmark = pytest.mark.distributed

_MISSING = [name for name in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING} (the wandb, mlflow and tensorboard extras)")
def test_every_tracker_gets_the_same_scalars(ranks2, tmp_path):
    model = save_tiny_chat_checkpoint(tmp_path / "model")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"recipe: sft\nmodel: {{path: {model}}}\ndata: {{path: {CHAT_DATA}, validation_path: {CHAT_DATA}}}\n"
        "train: {max_steps: 4, global_batch_size: 4, micro_batch_size: 2, seq_len: 32, eval_every_steps: 2}\n"
    )
    overrides = [
        f"train.tensorboard_dir={tmp_path / 'tb'}",
        "log.wandb.project=automodel-test",
        "log.wandb.mode=offline",
        f"log.wandb.dir={tmp_path}",
        "log.mlflow.experiment=automodel-test",
        f"log.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}",
    ]
    stored = ranks2.run(train_with_trackers, str(config), overrides)[0]
    tensorboard, wandb, mlflow = stored["tensorboard"], stored["wandb"], stored["mlflow"]
    params = mlflow.pop("params")
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"}
    assert set(tensorboard) == set(wandb) == set(mlflow) == expected, (tensorboard, wandb, mlflow)
    assert [step for step, _ in tensorboard["eval/loss"]] == [2, 4]
    for key in expected:
        assert (
            [step for step, _ in wandb[key]]
            == [step for step, _ in tensorboard[key]]
            == [step for step, _ in mlflow[key]]
        ), key
        for (_, board), (_, weights), (_, flow) in zip(tensorboard[key], wandb[key], mlflow[key], strict=True):
            assert weights == flow and board == pytest.approx(weights, rel=1e-6), key  # TensorBoard stores float32
    assert [value for _, value in wandb["train/loss"]] == stored["losses"]
    assert params["train.max_steps"] == "4" and params["log.wandb.mode"] == "offline"
