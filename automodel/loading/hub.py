"""Resolve a model id or local path to a checkpoint directory, downloading once per node through the HF cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from .agreement import agree_or_raise
from .checkpoint_files import weight_files

try:  # huggingface_hub >= 1.x: offline, a snapshot its cached tree listing shows to be partial
    from huggingface_hub.errors import IncompleteSnapshotError
except ImportError:  # older releases return such a snapshot as it is
    IncompleteSnapshotError = None

__all__ = ["HubOptions", "resolve_adapter_dir", "resolve_checkpoint_dir", "resolve_config_dir"]

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
# The weight files are the ones transformers loads, in the order checkpoint_files.open_checkpoint looks for them
# (checkpoint_files.weight_files): the single file, else an index and the shards it names. Never a pattern like
# "*.safetensors": repos also ship other weights (Mistral's consolidated.safetensors, original/ folders) that would
# double the download.
REMOTE_CODE_PATTERNS = ["*.py"]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class HubOptions:
    """How a checkpoint is found and fetched, with ``from_pretrained``'s meanings.

    Args:
        revision: branch, tag or commit of a hub id.
        cache_dir: the Hugging Face cache to use (default: ``HF_HUB_CACHE``).
        local_files_only: never download (also ``HF_HUB_OFFLINE=1``).
        token: hub token, for gated and private repositories.
        trust_remote_code: also fetch the model's Python files.
        force_download: download the files again even if they are cached.
        subfolder: the checkpoint lies in this folder of the repository or directory.
        use_safetensors: ``None`` prefers safetensors, ``True`` requires them, ``False`` reads ``.bin`` files.
        variant: the weights' variant, e.g. ``"fp16"`` for ``model.fp16.safetensors``.
    """

    revision: str | None = None
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False
    token: str | bool | None = None
    trust_remote_code: bool = False
    force_download: bool = False
    subfolder: str = ""
    use_safetensors: bool | None = None
    variant: str | None = None


def resolve_checkpoint_dir(
    name_or_path: str | os.PathLike, options: HubOptions | None = None, **option_values: Any
) -> Path:
    """A local directory holding the checkpoint: ``name_or_path`` itself (or its ``subfolder``), or the hub snapshot
    of that id (``options`` as a ``HubOptions`` or its fields as keywords).

    Only what loading needs is fetched (config, generation config, the weight files the index names, tokenizer
    files, and the model's Python files when ``trust_remote_code``). Under ``torch.distributed`` the first rank of each
    node downloads while the others wait, then they all read the same cache; a failure any rank sees is raised on
    every rank. ``HF_HUB_OFFLINE``, ``HF_HOME`` / ``cache_dir``, ``revision`` and ``local_files_only`` mean what they
    mean in ``huggingface_hub``.
    """
    options = options or HubOptions(**option_values)
    directory, error = None, None
    try:
        directory = _resolve(name_or_path, options)
    except Exception as exc:  # raised below on every rank, so that no rank goes on alone into a collective
        error = exc
    agree_or_raise(error, f"Resolving {name_or_path}")
    return directory


def resolve_config_dir(name_or_path: str | os.PathLike, options: HubOptions | None = None) -> Path:
    """A local directory holding the model's config: ``name_or_path`` itself, or the hub snapshot of that id with
    only its metadata fetched (config, index, tokenizer files; never the weights, though weights already in the
    cache are there to read headers from). No process group is involved (``automodel.plan`` runs before any)."""
    options = options or HubOptions()
    path = Path(name_or_path)
    if path.is_dir():
        return _in_subfolder(path, options.subfolder, name_or_path)
    if path.is_absolute() or str(name_or_path).startswith((".", "~")) or str(name_or_path).count("/") > 1:
        raise FileNotFoundError(f"{name_or_path} is neither a local directory nor a Hugging Face model id.")
    offline = options.local_files_only or constants.HF_HUB_OFFLINE
    patterns = METADATA_PATTERNS + ["*.index.json"] + (REMOTE_CODE_PATTERNS if options.trust_remote_code else [])
    try:
        snapshot = snapshot_download(
            str(name_or_path),
            revision=options.revision,
            cache_dir=options.cache_dir,
            token=options.token,
            local_files_only=offline,
            allow_patterns=patterns,
        )
    except LocalEntryNotFoundError as error:
        raise _not_in_cache(str(name_or_path), options.revision, options.cache_dir, offline, error) from error
    return _in_subfolder(Path(snapshot), options.subfolder, name_or_path)


def _resolve(name_or_path: str | os.PathLike, options: HubOptions) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return _in_subfolder(path, options.subfolder, name_or_path)
    if path.is_absolute() or str(name_or_path).startswith((".", "~")) or str(name_or_path).count("/") > 1:
        raise FileNotFoundError(f"{name_or_path} is neither a local directory nor a Hugging Face model id.")
    repo_id = str(name_or_path)
    offline = options.local_files_only or constants.HF_HUB_OFFLINE
    prefix = f"{options.subfolder.strip('/')}/" if options.subfolder else ""

    def fetch(patterns: list[str], only_local: bool, commit: str | None) -> Path:
        return Path(
            snapshot_download(
                repo_id,
                revision=commit or options.revision,
                cache_dir=options.cache_dir,
                token=options.token,
                local_files_only=only_local,
                force_download=options.force_download and not only_local,
                allow_patterns=[prefix + pattern for pattern in patterns],
            )
        )

    metadata = METADATA_PATTERNS + (REMOTE_CODE_PATTERNS if options.trust_remote_code else [])
    files = weight_files(options.use_safetensors, options.variant, diffusers=False)
    try:
        snapshot = _once_per_node(
            lambda: _fetch_weights(fetch, offline, metadata, files, prefix),
            lambda: _fetch_weights(fetch, True, metadata, files, prefix),
        )
    except LocalEntryNotFoundError as error:
        raise _not_in_cache(repo_id, options.revision, options.cache_dir, offline, error) from error
    return _in_subfolder(snapshot, options.subfolder, name_or_path)


def resolve_adapter_dir(name_or_path: str | os.PathLike, options: HubOptions | None = None) -> Path:
    """A local folder holding a peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``): the path itself,
    or the hub snapshot of that id with only those two files; a failure any rank sees is raised on every rank."""
    options = options or HubOptions()
    directory, error = None, None
    try:
        path = Path(name_or_path)
        if path.is_dir():
            directory = _in_subfolder(path, options.subfolder, name_or_path)
        else:
            offline = options.local_files_only or constants.HF_HUB_OFFLINE
            prefix = f"{options.subfolder.strip('/')}/" if options.subfolder else ""

            def fetch(only_local: bool) -> Path:
                return Path(
                    snapshot_download(
                        str(name_or_path),
                        revision=options.revision,
                        cache_dir=options.cache_dir,
                        token=options.token,
                        local_files_only=only_local,
                        allow_patterns=[prefix + name for name in ADAPTER_FILES],
                    )
                )

            try:
                snapshot = _once_per_node(lambda: fetch(offline), lambda: fetch(True))
            except LocalEntryNotFoundError as exc:
                raise _not_in_cache(str(name_or_path), options.revision, options.cache_dir, offline, exc) from exc
            directory = _in_subfolder(snapshot, options.subfolder, name_or_path)
    except Exception as exc:  # raised below on every rank
        error = exc
    agree_or_raise(error, f"Resolving the adapter {name_or_path}")
    return directory


def _in_subfolder(directory: Path, subfolder: str, name_or_path: str | os.PathLike) -> Path:
    if not subfolder:
        return directory
    inner = directory / subfolder
    if not inner.is_dir():
        raise FileNotFoundError(f"{name_or_path} has no subfolder {subfolder!r}.")
    return inner


def _fetch_weights(
    fetch, only_local: bool, metadata: list[str], files: list[tuple[str, str, bool]], prefix: str
) -> Path:
    """The snapshot with the metadata and the weight files loading reads (see ``weight_files``), nothing else.

    Every call after the first asks for the commit the first one resolved (the snapshot folder's name), so the
    index and its shards come from one commit even if the branch moves meanwhile.
    """
    directory = fetch(metadata, only_local, None)
    commit = directory.name
    for name, _, is_index in files:
        directory = fetch([name], only_local, commit)
        if (directory / prefix / name).is_file():
            return (
                fetch([name, *_shard_names(directory / prefix / name)], only_local, commit) if is_index else directory
            )
    return directory  # no weights: open_checkpoint says so


def _shard_names(index: Path) -> list[str]:
    """The files an index's ``weight_map`` names (none when it cannot be read: open_checkpoint reports that)."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


def _not_in_cache(
    repo_id: str,
    revision: str | None,
    cache_dir: str | os.PathLike | None,
    offline: bool,
    error: LocalEntryNotFoundError,
) -> FileNotFoundError:
    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    why = "downloading is disabled (HF_HUB_OFFLINE=1 or local_files_only=True)" if offline else "the hub is unreachable"
    where = f"Model {repo_id!r} (revision {revision or 'main'})"
    if IncompleteSnapshotError is not None and isinstance(error, IncompleteSnapshotError):
        return FileNotFoundError(
            f"{where} is only partly in the Hugging Face cache {cache} and {why}: {error} Download it again where the "
            f"hub is reachable (`hf download {repo_id}`), or pass a local directory."
        )
    return FileNotFoundError(
        f"{where} is not in the Hugging Face cache {cache} and {why}. Download it where the hub is reachable "
        f"(`hf download {repo_id}`) into that cache, set HF_HOME or cache_dir to the cache that has it, or pass a "
        "local directory."
    )


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
