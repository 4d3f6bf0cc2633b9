"""``save_pretrained`` and ``push_to_hub`` of a parallelized model, with transformers' arguments: collective, and
writing the consolidated checkpoint of :func:`export.write_checkpoint` (every rank writing its own shards' bytes,
staged and moved into place). Registered with ``automodel.distributed.parallel_model`` when ``automodel.loading`` is imported.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from automodel.distributed.parallel_model import register_checkpoint_writer
from automodel.distributed.runtime import is_rank_zero

from .agreement import agree_or_raise
from .export import replace_weights_in, write_checkpoint
from .model_card import push_to_hub as upload_folder

__all__ = ["ConsolidatedCheckpointWriter"]

# transformers' push_to_hub keywords that save_pretrained(push_to_hub=True, ...) forwards.
_PUSH_KEYWORDS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr")


class ConsolidatedCheckpointWriter:
    """The collective ``save_pretrained`` / ``push_to_hub`` of parallelized models."""

    def save_pretrained(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        variant: str | None = None,
        token: str | bool | None = None,
        save_peft_format: bool = True,
        save_original_format: bool = True,
        distributed_checkpoint: bool = False,
        safe_serialization: bool = True,
        **push_kwargs: Any,
    ) -> None:
        """transformers' ``save_pretrained``, called on every rank: writes ``model.safetensors`` (or the shards and
        their index; every rank its own shards' bytes), ``config.json`` and ``generation_config.json`` into
        ``save_directory``, replacing the weight files already there and keeping the other files, as transformers
        does. ``is_main_process`` is not needed (the ranks share the writing). The arguments this cannot honour are refused, naming them."""
        _refuse_unsupported(state_dict, save_original_format, distributed_checkpoint, safe_serialization)
        unknown = sorted(set(push_kwargs) - set(_PUSH_KEYWORDS))
        if unknown:
            raise TypeError(f"save_pretrained got unexpected keyword arguments {unknown}.")
        directory = write_checkpoint(
            model,
            save_directory,
            place=functools.partial(replace_weights_in, variant=variant),
            max_shard_size=max_shard_size,
            variant=variant,
        )
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or Path(save_directory).name
            _upload_from_rank_zero(directory, repo_id, token=token, **push_kwargs)

    def push_to_hub(
        self,
        model: nn.Module,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ) -> str:
        """transformers' ``push_to_hub``, called on every rank: the consolidated checkpoint is written to a temporary
        folder (rank 0's, named the same on every rank) and uploaded from rank 0; every rank returns the commit URL.
        When the upload fails, every rank raises naming that folder, which is kept for a later ``hf upload``."""
        if tags:
            raise ValueError("push_to_hub(tags=...) is not supported: add the tags to the repo's model card.")
        staging = _temporary_folder_of_rank_zero()
        target = staging / "checkpoint"
        uploaded = False
        try:
            write_checkpoint(model, target, place=replace_weights_in, max_shard_size=max_shard_size or "50GB")
            url = _upload_from_rank_zero(
                target,
                repo_id,
                token=token,
                kept=True,
                private=private,
                commit_message=commit_message,
                commit_description=commit_description,
                revision=revision,
                create_pr=create_pr,
            )
            uploaded = True
            return url
        finally:
            if is_rank_zero() and (uploaded or not target.exists()):
                shutil.rmtree(staging, ignore_errors=True)


def _refuse_unsupported(
    state_dict: dict | None, save_original_format: bool, distributed_checkpoint: bool, safe_serialization: bool
) -> None:
    if distributed_checkpoint:
        raise ValueError(
            "save_pretrained(distributed_checkpoint=True) is not supported for a parallelized model: save_pretrained "
            "writes one consolidated safetensors checkpoint, which from_pretrained loads under any layout. Sharded, "
            "resumable checkpoints of a training run are automodel.training's (torch.distributed.checkpoint)."
        )
    if state_dict is not None:
        raise ValueError(
            "save_pretrained(state_dict=...) is not supported for a parallelized model: it saves the model's own "
            "(sharded) weights, each rank writing its own shards."
        )
    if not save_original_format:
        raise ValueError(
            "save_pretrained(save_original_format=False) is not supported: the checkpoint is written in "
            "the layout transformers' from_pretrained reads (its original format)."
        )
    if not safe_serialization:
        raise ValueError(
            "save_pretrained(safe_serialization=False) is not supported: weights are written as safetensors."
        )


def _temporary_folder_of_rank_zero() -> Path:
    """Collective: a new temporary folder made by rank 0, its path on every rank."""
    folder = Path(tempfile.mkdtemp(prefix="automodel-push-")) if is_rank_zero() else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [folder]
        dist.broadcast_object_list(shared, src=0)
        folder = shared[0]
    return folder


def _upload_from_rank_zero(
    directory: Path, repo_id: str, *, token: Any = None, kept: bool = False, **options: Any
) -> str:
    """Upload ``directory`` from rank 0, the error (if any) raised on every rank, naming ``directory`` (and, with
    ``kept``, saying that it stays for a later upload); every rank returns the URL."""
    url, error = None, None
    if is_rank_zero():
        try:
            url = upload_folder(directory, repo_id, token=token, **{k: v for k, v in options.items() if v is not None})
        except Exception as exc:  # raised below on every rank
            error = exc
    later = f" (the checkpoint stays there: upload it later with `hf upload {repo_id} {directory}`)" if kept else ""
    agree_or_raise(error, f"Uploading {directory} to {repo_id}{later}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [url]
        dist.broadcast_object_list(shared, src=0)
        url = shared[0]
    return url


register_checkpoint_writer(ConsolidatedCheckpointWriter())
