"""Loading by hub id from a local Hugging Face cache, never reaching the network.

The cache is laid out byte for byte as ``huggingface_hub`` 2.4 writes it (``file_download.hf_hub_download`` and
``_snapshot_download.snapshot_download``): ``models--org--name/blobs/<etag>`` (the sha256 of the content for LFS
files, the git blob sha1 for small text files), ``snapshots/<commit>/<path>`` as relative symlinks into ``blobs``,
``refs/<branch or tag>`` holding the commit hash without a newline, ``trees/<commit>.json`` (the repo's tree listing
that ``snapshot_download`` caches and checks offline), ``.no_exist/<commit>/<path>`` for files a download found absent,
and ``CACHEDIR.TAG`` at the cache root. ``huggingface_hub.scan_cache_dir`` reads it back as a test of the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import get_cached_repo_tree, scan_cache_dir, try_to_load_from_cache
from huggingface_hub.file_download import _CACHED_NO_EXIST
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.loading import resolve_checkpoint_dir
from tests.cases import loading_errors as cases
from tests.tiny_models import VOCAB, save_tiny_checkpoint, token_batch

REPO_ID = "tiny-org/tiny-llama"
MAIN_COMMIT = hashlib.sha1(b"main commit").hexdigest()
V1_COMMIT = hashlib.sha1(b"v1 commit").hexdigest()
FSDP2 = {"strategy": "fsdp2"}
TIMEOUT_S = 90.0  # a rank left waiting shows up as a RankFailure after this long
LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".model", ".pt", ".pth")  # the default .gitattributes LFS rules
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by huggingface_hub.\n"
    "# For information about cache directory tags, see:\n"
    "#\thttps://bford.info/cachedir/\n"
)


# ------------------------------------------------------------------------------------------------ the cache layout


def _git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _tree_entry(path: str, content: bytes) -> dict:
    """The tree listing entry the hub's ``/tree`` endpoint gives a file (``_tree_cache.TreeCacheEntry``)."""
    if not path.endswith(LFS_SUFFIXES):
        return {"size": len(content), "blob_id": _git_blob_sha1(content)}
    sha256 = hashlib.sha256(content).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n".encode()
    return {"size": len(content), "blob_id": _git_blob_sha1(pointer), "lfs_sha256": sha256, "lfs_size": len(content)}


def _etag(path: str, content: bytes) -> str:
    """The blob's file name: the ETag the hub serves (sha256 for LFS files, the git blob sha1 otherwise)."""
    entry = _tree_entry(path, content)
    return entry.get("lfs_sha256", entry["blob_id"])


def add_snapshot(
    cache: Path,
    repo_id: str,
    commit: str,
    files: dict[str, bytes],
    *,
    refs: tuple[str, ...] = (),
    not_downloaded: dict[str, bytes] | None = None,
    absent: tuple[str, ...] = (),
) -> Path:
    """Put ``files`` (repo path -> content) into ``cache`` as snapshot ``commit`` of ``repo_id``; return its folder.

    ``not_downloaded`` are files the repo has (they are in the tree listing) that were not fetched; ``absent`` are
    files a download looked for and the repo does not have (``.no_exist``).
    """
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for path, content in files.items():
        blob = storage / "blobs" / _etag(path, content)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        pointer = snapshot / path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, start=pointer.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    listing = {**files, **(not_downloaded or {})}
    tree = {"format_version": 1, "files": {path: _tree_entry(path, listing[path]) for path in sorted(listing)}}
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps(tree, indent=1))
    for path in absent:
        (storage / ".no_exist" / commit / path).parent.mkdir(parents=True, exist_ok=True)
        (storage / ".no_exist" / commit / path).touch()
    (cache / "CACHEDIR.TAG").write_text(CACHEDIR_TAG)
    return snapshot


def _save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary (``tokenizer.json`` + ``tokenizer_config.json``)."""
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, Path]:
    """``HF_HOME`` with a ``hub/`` cache holding ``REPO_ID`` at ``main`` (seed 0) and tag ``v1`` (seed 1), plus the
    directories the snapshots were made from (the oracle loads those with plain transformers)."""
    root = tmp_path_factory.mktemp("hub")
    main = save_tiny_checkpoint("llama", root / "saved-main", seed=0)
    _save_tokenizer(main)
    v1 = save_tiny_checkpoint("llama", root / "saved-v1", seed=1)
    cache = root / "hf_home" / "hub"
    main_files = _files(main)
    main_files["other.onnx"] = bytes(2 * 2**20)  # a big file loading does not need
    add_snapshot(
        cache,
        REPO_ID,
        MAIN_COMMIT,
        main_files,
        refs=("main",),
        # what a repo often has besides the transformers weights; fetching them would double the download
        not_downloaded={"consolidated.safetensors": b"\0" * 64, "original/params.json": b"{}", "README.md": b"# x"},
        absent=("model.safetensors", "adapter_config.json"),  # transformers looked for these and found none
    )
    add_snapshot(cache, REPO_ID, V1_COMMIT, _files(v1), refs=("v1",))
    incomplete = _files(main)  # an interrupted download: the listing names a shard the snapshot lacks
    lost_shard = incomplete.pop("model-00002-of-00003.safetensors")
    add_snapshot(
        cache,
        "tiny-org/interrupted",
        MAIN_COMMIT,
        incomplete,
        refs=("main",),
        not_downloaded={"model-00002-of-00003.safetensors": lost_shard},
    )
    return {"home": root / "hf_home", "cache": cache, "main": main, "v1": v1, "empty_cache": root / "empty" / "hub"}


# ----------------------------------------------------------------------------------------------------------- tests


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(hub):
    info = scan_cache_dir(hub["cache"])
    assert not info.warnings, info.warnings
    repo = next(repo for repo in info.repos if repo.repo_id == REPO_ID)
    assert {revision.commit_hash: set(revision.refs) for revision in repo.revisions} == {
        MAIN_COMMIT: {"main"},
        V1_COMMIT: {"v1"},
    }
    cached = try_to_load_from_cache(REPO_ID, "config.json", cache_dir=hub["cache"])
    assert cached == str(hub["cache"] / f"models--tiny-org--tiny-llama/snapshots/{MAIN_COMMIT}/config.json")
    assert Path(cached).read_bytes() == (hub["main"] / "config.json").read_bytes()
    blob_link = os.readlink(hub["cache"] / f"models--tiny-org--tiny-llama/snapshots/{MAIN_COMMIT}/config.json")
    assert blob_link == f"../../blobs/{_git_blob_sha1((hub['main'] / 'config.json').read_bytes())}"
    assert try_to_load_from_cache(REPO_ID, "adapter_config.json", cache_dir=hub["cache"]) is _CACHED_NO_EXIST
    assert "consolidated.safetensors" in {f.path for f in get_cached_repo_tree(REPO_ID, cache_dir=hub["cache"])}


def test_hub_id_loads_from_the_cache_like_transformers(hub):
    kwargs = {"cache_dir": str(hub["cache"]), "local_files_only": True}
    result = cases.loaded_logits(REPO_ID, None, **kwargs)
    assert result["logits"] <= 1e-4 and not result["on_meta"], result
    assert result["name_or_path"] == REPO_ID
    # and the weights are those that were saved (the oracle reading the same cache cannot tell)
    model = NeMoAutoModelForCausalLM.from_pretrained(REPO_ID, **kwargs)
    saved = AutoModelForCausalLM.from_pretrained(hub["main"])
    with torch.no_grad():
        assert (model(token_batch()).logits - saved(token_batch()).logits).abs().max() <= 1e-4
    assert model.generation_config.to_dict() == saved.generation_config.to_dict()


def test_hub_options_subfolder_and_force_download_offline(hub, tmp_path):
    """A snapshot with the checkpoint in a subfolder; force_download has nothing to fetch again offline."""
    add_snapshot(
        tmp_path,
        "tiny-org/nested",
        MAIN_COMMIT,
        {f"weights/{k}": v for k, v in _files(hub["main"]).items()},
        refs=("main",),
    )
    kwargs = {"cache_dir": str(tmp_path), "local_files_only": True, "force_download": True}
    model = NeMoAutoModelForCausalLM.from_pretrained("tiny-org/nested", subfolder="weights", **kwargs)
    saved = AutoModelForCausalLM.from_pretrained(hub["main"])
    with torch.no_grad():
        assert (model(token_batch()).logits - saved(token_batch()).logits).abs().max() <= 1e-4
    directory = resolve_checkpoint_dir(
        "tiny-org/nested", subfolder="weights", cache_dir=tmp_path, local_files_only=True
    )
    assert directory == tmp_path / "models--tiny-org--nested" / "snapshots" / MAIN_COMMIT / "weights"


def test_tokenizer_files_come_with_the_weights(hub):
    directory = resolve_checkpoint_dir(REPO_ID, cache_dir=hub["cache"], local_files_only=True)
    assert directory == hub["cache"] / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_COMMIT
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer("w1 w5 w7")["input_ids"] == [1, 5, 7]


def test_hf_hub_offline_and_hf_home_are_honoured(hub):
    # huggingface_hub reads HF_HUB_OFFLINE and HF_HOME when it is imported: a fresh interpreter sees them
    script = textwrap.dedent(
        f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        from automodel.auto_model import NeMoAutoModelForCausalLM
        from tests.tiny_models import token_batch

        model = NeMoAutoModelForCausalLM.from_pretrained({REPO_ID!r})
        saved = AutoModelForCausalLM.from_pretrained({str(hub["main"])!r})
        with torch.no_grad():
            print(json.dumps({{"logits": (model(token_batch()).logits - saved(token_batch()).logits).abs().max().item()}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hub["home"])}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_ENDPOINT"):
        env.pop(name, None)
    repo_root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["logits"] <= 1e-4


def test_revision_selects_the_snapshot_its_ref_points_to(hub):
    kwargs = {"cache_dir": str(hub["cache"]), "local_files_only": True}
    saved_v1 = AutoModelForCausalLM.from_pretrained(hub["v1"])
    batch = token_batch()
    for revision in ("v1", V1_COMMIT):
        model = NeMoAutoModelForCausalLM.from_pretrained(REPO_ID, revision=revision, **kwargs)
        with torch.no_grad():
            assert (model(batch).logits - saved_v1(batch).logits).abs().max() <= 1e-4, revision
    main = NeMoAutoModelForCausalLM.from_pretrained(REPO_ID, **kwargs)
    with torch.no_grad():
        assert (main(batch).logits - saved_v1(batch).logits).abs().max() > 1e-2  # main really is other weights
    assert cases.loaded_logits(REPO_ID, None, revision="v1", **kwargs)["logits"] <= 1e-4


def test_id_missing_from_the_cache_names_the_id_and_the_cache(hub):
    with pytest.raises(FileNotFoundError) as error:
        NeMoAutoModelForCausalLM.from_pretrained("tiny-org/absent", cache_dir=hub["cache"], local_files_only=True)
    message = str(error.value)
    assert "'tiny-org/absent' (revision main) is not in the Hugging Face cache" in message
    assert str(hub["cache"]) in message and "local_files_only=True" in message


def test_revision_missing_from_the_cache_names_the_revision(hub):
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/tiny-llama' \(revision v2\) is not in"):
        NeMoAutoModelForCausalLM.from_pretrained(REPO_ID, revision="v2", cache_dir=hub["cache"], local_files_only=True)


def test_only_the_files_loading_needs_are_required(hub):
    # The tree listing names consolidated.safetensors and original/params.json, never downloaded; the snapshot holds
    # other.onnx. Offline, huggingface_hub refuses a snapshot missing a file the requested patterns match, so this
    # loads only if the loader asks for exactly the weights the index names (not every *.safetensors).
    directory = resolve_checkpoint_dir(REPO_ID, cache_dir=hub["cache"], local_files_only=True)
    assert (directory / "other.onnx").is_file() and not (directory / "consolidated.safetensors").exists()
    result = cases.loaded_logits(REPO_ID, None, cache_dir=str(hub["cache"]), local_files_only=True)
    assert result["logits"] <= 1e-4, result


def test_interrupted_download_names_the_missing_shard(hub):
    with pytest.raises(FileNotFoundError) as error:
        NeMoAutoModelForCausalLM.from_pretrained("tiny-org/interrupted", cache_dir=hub["cache"], local_files_only=True)
    message = str(error.value)
    assert "tiny-org/interrupted" in message and "incomplete" in message
    assert "model-00002-of-00003.safetensors" in message


@pytest.mark.distributed
def test_ranks_load_from_the_cache_once_per_node(ranks2, hub):
    # Rank 0 (LOCAL_RANK 0) resolves first while rank 1 waits at the barrier, then reads the same snapshot offline.
    kwargs = {"cache_dir": str(hub["cache"]), "local_files_only": True}
    directories = ranks2.run(cases.resolved_directory, REPO_ID, timeout=TIMEOUT_S, **kwargs)
    assert directories == [str(hub["cache"] / "models--tiny-org--tiny-llama" / "snapshots" / MAIN_COMMIT)] * 2
    results = ranks2.run(cases.loaded_logits, REPO_ID, FSDP2, timeout=TIMEOUT_S, **kwargs)
    for result in results:
        assert result["logits"] <= 1e-4 and not result["on_meta"] and result["sharded"] > 0, result
    assert results[0]["logits_sum"] == results[1]["logits_sum"]


@pytest.mark.distributed
def test_fetch_failure_only_the_leader_sees_is_raised_on_every_rank(ranks2, hub):
    # Rank 0 (the node's leader, which fetches) finds nothing; rank 1 would find the model. The stand-in for a leader
    # whose download fails (gated repo, expired token) while an older snapshot is in the cache: the follower must not
    # go on alone and wait for rank 0 in the loader's first collective.
    cache_dirs = [str(hub["empty_cache"]), str(hub["cache"])]
    kwargs = {"revision": "v1", "cache_dir": cache_dirs, "local_files_only": True}
    messages = ranks2.run(cases.load_error, REPO_ID, FSDP2, timeout=TIMEOUT_S, **kwargs)
    assert messages[0] == messages[1], messages
    # Both ranks raise the failing rank's own exception class, as one process would.
    assert messages[0].startswith(f"FileNotFoundError: Resolving {REPO_ID} failed on 1 of 2 ranks:"), messages[0]
    assert f"rank 0: FileNotFoundError: Model {REPO_ID!r} (revision v1) is not in the Hugging Face cache" in messages[0]
    assert str(hub["empty_cache"]) in messages[0] and "rank 1:" not in messages[0]
