"""Checkpoint I/O: hub resolution, the sharded safetensors reader, and the HF-format writer.

Importing it registers the consolidated writer behind ``save_pretrained`` / ``push_to_hub`` of parallelized models.
"""

from .checkpoint_files import (
    CheckpointError,
    CheckpointFiles,
    MissingCheckpointFileError,
    open_checkpoint,
    read_json,
    stored_dtype,
)
from .hub import resolve_checkpoint_dir
from .loader import CheckpointPlan, load_checkpoint, materialize, plan_checkpoint
from .save_pretrained import ConsolidatedCheckpointWriter
from .sharded_loader import LoadReport

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointPlan",
    "ConsolidatedCheckpointWriter",
    "LoadReport",
    "MissingCheckpointFileError",
    "load_checkpoint",
    "materialize",
    "open_checkpoint",
    "plan_checkpoint",
    "read_json",
    "resolve_checkpoint_dir",
    "stored_dtype",
]
