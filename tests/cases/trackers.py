"""Rank-side cases of ``test_trackers``: a short recipe run with every tracker on, then what each tracker stored."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from automodel.training.config import load_config
from automodel.training.loop import run

Series = dict[str, list[tuple[int, float]]]


def train_with_trackers(config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Train; on rank 0, the scalars TensorBoard, W&B (offline) and MLflow (a local file store) hold afterwards."""
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 keeps its file store, in maintenance mode, behind this
    config = load_config(config_path, overrides)
    result = run(config)
    if int(os.environ.get("RANK", 0)) != 0:
        return {}
    return {
        "losses": result.losses,
        "tensorboard": _tensorboard(config.train.tensorboard_dir),
        "wandb": _wandb(Path(config.log.wandb.dir)),
        "mlflow": _mlflow(config.log.mlflow.tracking_uri, config.log.mlflow.experiment),
    }


def _tensorboard(folder: str) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _wandb(folder: Path) -> Series:
    """The history records of the offline run's ``.wandb`` file: wandb's own record format (a LevelDB-style log of
    32 KiB blocks of CRC-framed chunks after a 7-byte header) holding protobuf ``Record`` messages. wandb 0.31 has no
    Python reader for it any more (its core, in Go, reads it)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, position, chunk, records = path.read_bytes(), 7, b"", []
    block = 32768
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            position += left
            continue
        chunk += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            records.append(chunk)
            chunk = b""
    series: Series = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key, value in items.items():
            if not key.startswith("_"):
                series.setdefault(key, []).append((items["_step"], value))
    return series


def _mlflow(tracking_uri: str, experiment: str) -> Series:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    (found,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {
        key: [(metric.step, metric.value) for metric in client.get_metric_history(found.info.run_id, key)]
        for key in found.data.metrics
    } | {"params": found.data.params}
