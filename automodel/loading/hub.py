"""Resolve a model id or local path to a checkpoint directory, downloading once per node through the HF cache."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

__all__ = ["resolve_checkpoint_dir"]

METADATA_PATTERNS = [
    "config.json",
    "generation_config.json",
    # tokenizer files, whichever the model ships
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
]
SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
REMOTE_CODE_PATTERNS = ["*.py"]


def resolve_checkpoint_dir(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """A local directory holding the checkpoint: ``name_or_path`` itself, or the hub snapshot of that id.

    Only what loading needs is fetched (config, generation config, weights, tokenizer files, and the model's Python
    files when ``trust_remote_code``). Under ``torch.distributed`` the first rank of each node downloads while the
    others wait, then they all read the same cache. ``HF_HUB_OFFLINE``, ``HF_HOME`` / ``cache_dir``, ``revision``
    and ``local_files_only`` mean what they mean in ``huggingface_hub``.
    """
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.is_absolute() or str(name_or_path).startswith((".", "~")) or str(name_or_path).count("/") > 1:
        raise FileNotFoundError(f"{name_or_path} is neither a local directory nor a Hugging Face model id.")
    repo_id = str(name_or_path)
    offline = local_files_only or constants.HF_HUB_OFFLINE

    def fetch(patterns: list[str], only_local: bool) -> Path:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=only_local,
                allow_patterns=patterns + (REMOTE_CODE_PATTERNS if trust_remote_code else []),
            )
        )

    def fetch_weights(only_local: bool) -> Path:
        directory = fetch(METADATA_PATTERNS + SAFETENSORS_PATTERNS, only_local)
        if not any(directory.glob("*.safetensors")):
            directory = fetch(METADATA_PATTERNS + BIN_PATTERNS, only_local)
        return directory

    try:
        return _once_per_node(lambda: fetch_weights(offline), lambda: fetch_weights(True))
    except LocalEntryNotFoundError as error:
        cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
        why = (
            "downloading is disabled (HF_HUB_OFFLINE=1 or local_files_only=True)"
            if offline
            else "the hub is unreachable"
        )
        raise FileNotFoundError(
            f"Model {repo_id!r} (revision {revision or 'main'}) is not in the Hugging Face cache {cache} and {why}. "
            f"Download it where the hub is reachable (`hf download {repo_id}`) into that cache, set HF_HOME or "
            "cache_dir to the cache that has it, or pass a local directory."
        ) from error


def _once_per_node(leader_fetch, follower_fetch):
    """The node's first rank runs ``leader_fetch``; the others run ``follower_fetch`` after it finished (or failed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return leader_fetch()
    is_leader = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    result, failure = None, None
    if is_leader:
        try:
            result = leader_fetch()
        except BaseException as error:  # re-raised below, after the others were released
            failure = error
    dist.barrier()
    if failure is not None:
        raise failure
    return result if is_leader else follower_fetch()
