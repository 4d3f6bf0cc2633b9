"""Checkpoint I/O: hub resolution, the sharded safetensors reader, and the HF-format writer."""

from .checkpoint_files import CheckpointError, CheckpointFiles, MissingCheckpointFileError, open_checkpoint, read_json
from .hub import resolve_checkpoint_dir
from .loader import CheckpointPlan, load_checkpoint, materialize, plan_checkpoint
from .sharded_loader import LoadReport

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointPlan",
    "LoadReport",
    "MissingCheckpointFileError",
    "load_checkpoint",
    "materialize",
    "open_checkpoint",
    "plan_checkpoint",
    "read_json",
    "resolve_checkpoint_dir",
]
