"""The model card of an export (``README.md`` whose metadata ``huggingface_hub.ModelCard`` parses) and the upload
of an export to the hub."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

__all__ = ["ModelCardInfo", "push_to_hub", "write_model_card"]


@dataclass(frozen=True)
class ModelCardInfo:
    """What the model card says about a trained model.

    ``base_model``: the hub id or path training started from (a local path is named in the text, not the metadata,
    which the hub checks against its repos). ``training_summary``: the training configuration worth reporting, e.g.
    ``{"recipe": "sft", "steps": 30, "global_batch_size": 8, "lr": 1e-4, "layout": {...}}``.
    """

    base_model: str | None
    training_summary: dict
    tags: tuple[str, ...] = ()
    license: str | None = None
    datasets: tuple[str, ...] = ()


def write_model_card(directory: str | os.PathLike, info: ModelCardInfo, *, model_id: str) -> Path:
    """Write ``README.md`` into ``directory``: YAML metadata that ``huggingface_hub.ModelCard.load`` parses
    (base_model, library_name, tags incl. "automodel", license, datasets, pipeline_tag, the training summary), a short
    description with the training summary as a table, and usage snippets for plain transformers and for
    ``NeMoAutoModelForCausalLM``. Returns the path of the card."""
    if not isinstance(info, ModelCardInfo):
        raise TypeError(f"info must be a ModelCardInfo, got {type(info).__name__}.")
    summary = _plain(info.training_summary)
    hub_base_model = info.base_model if info.base_model and _is_hub_id(info.base_model) else None
    data = ModelCardData(
        base_model=hub_base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=info.license,
        datasets=list(info.datasets) or None,
        tags=list(dict.fromkeys(("automodel", *info.tags))),
        training_config=summary,
    )
    content = f"---\n{data.to_yaml()}\n---\n\n{_card_body(info, summary, model_id)}"
    path = Path(directory) / "README.md"
    ModelCard(content).save(path)
    return path


def push_to_hub(
    directory: str | os.PathLike,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool = False,
    commit_message: str = "Upload model trained with automodel",
    commit_description: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Upload an export (``save_hf_checkpoint``'s directory) to the hub repo ``repo_id``, creating the repo if needed;
    return the commit URL (of the pull request with ``create_pr``). Call it on one process (e.g. rank 0), after the
    export."""
    folder = Path(directory)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json, so it is not an export: write it with save_hf_checkpoint first."
        )
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, exist_ok=True, private=private)
    optional = {"commit_description": commit_description, "revision": revision, "create_pr": create_pr or None}
    commit = api.upload_folder(
        repo_id=getattr(repo, "repo_id", repo_id),
        folder_path=folder,
        commit_message=commit_message,
        repo_type="model",
        **{key: value for key, value in optional.items() if value is not None},
    )
    return commit.pr_url if create_pr and getattr(commit, "pr_url", None) else commit.commit_url


def _is_hub_id(name: str) -> bool:
    if os.path.isabs(name) or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _plain(value: Any) -> Any:
    """``value`` as plain YAML/JSON types (tuples to lists, anything else unknown to its string)."""
    return json.loads(json.dumps(value, default=str))


def _card_body(info: ModelCardInfo, summary: dict, model_id: str) -> str:
    start = f"starting from `{info.base_model}`" if info.base_model else "from scratch"
    rows = "\n".join(f"| {key} | {_cell(value)} |" for key, value in summary.items())
    return f"""# {Path(model_id).name or model_id}

This model was trained with automodel {start}. It loads in plain transformers.

## Training

| Setting | Value |
| --- | --- |
{rows}

## Usage

With plain transformers:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model_id}")
model = AutoModelForCausalLM.from_pretrained("{model_id}")
```

Parallelized across the ranks of a `torchrun` job, each rank loading only its shards:

```python
from automodel import MeshContext, NeMoAutoModelForCausalLM

model = NeMoAutoModelForCausalLM.from_pretrained("{model_id}", mesh_context=MeshContext.build("fsdp2"))
```
"""


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")
