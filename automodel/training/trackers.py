"""Where rank 0 sends the training scalars besides the log: TensorBoard (``train.tensorboard_dir``), Weights & Biases
(``log.wandb.project``) and MLflow (``log.mlflow.experiment``). Each gets the same scalars at the same steps
(``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu`` with a peak,
``train/pipeline_bubble`` under PP, ``eval/loss``). The packages are optional extras, imported only when asked for
(the config check says which is missing, before any process starts)."""

from __future__ import annotations

from typing import Any

from .config import RecipeConfig

__all__ = ["Trackers"]


class Trackers:
    """The trackers a config asks for, on rank 0 (elsewhere, and when none is asked for, it does nothing)."""

    def __init__(self, config: RecipeConfig, *, rank: int) -> None:
        self._sinks: list[Any] = []
        if rank != 0:
            return
        if config.train.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._sinks.append(_TensorBoard(SummaryWriter(config.train.tensorboard_dir)))
        if config.log.wandb.project is not None:
            self._sinks.append(_WandB(config))
        if config.log.mlflow.experiment is not None:
            self._sinks.append(_MLflow(config))

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Log ``values`` (``"train/loss": 2.3, ...``) at ``step`` to every tracker."""
        for sink in self._sinks:
            sink.scalars(values, step)

    def close(self) -> None:
        """Flush and end every tracker's run."""
        for sink in self._sinks:
            sink.close()


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, config: RecipeConfig) -> None:
        import wandb

        settings = config.log.wandb
        self.run = wandb.init(
            project=settings.project,
            name=settings.name,
            mode=settings.mode,
            dir=settings.dir,
            config=config.to_dict(),
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, config: RecipeConfig) -> None:
        import mlflow

        settings = config.log.mlflow
        self.client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name).info.run_id
        for key, value in _flat(config.to_dict()).items():
            self.client.log_param(self.run_id, key, value)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.client.log_metric(self.run_id, name, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
