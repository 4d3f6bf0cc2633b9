"""The end of a run: the trained model exported to ``export.dir`` (a checkpoint plain transformers loads, with a
model card; with LoRA the merged model, the adapter, or both), then published to ``export.push_to_hub``
(``hub_upload``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from .config import LayoutSection, RecipeConfig
from .hub_upload import publish

__all__ = ["export_trained", "training_summary"]


def export_trained(config: RecipeConfig, model: nn.Module, tokenizer: Any) -> Path:
    """Collective: write the export ``config.export`` asks for, and publish it; its folder.

    The export goes into ``export.dir`` as ``save_pretrained`` saves: its files replace those of the same names and the
    weight files of an earlier export, and every other file in the folder stays (a user's notes, a ``checkpoint.dir``
    or ``log.dir`` inside it). The command refuses, before launch, an ``export.dir`` that is ``model.path``."""
    from automodel.loading.export import ModelCardInfo, replace_weights_in, write_checkpoint

    summary = training_summary(config)
    if config.lora.rank:
        from automodel.lora import merge_lora
        from automodel.lora_checkpoint import save_lora_adapter

        export = Path(config.export.dir)
        if config.export.lora == "adapter":
            return _publish(config, _export_adapter(model, export, tokenizer))
        if config.export.lora == "both":  # the adapter first: merging folds it away
            adapter = save_lora_adapter(model, export.parent / f".{export.name}.adapter")
        model = merge_lora(model)  # the merged export is a plain checkpoint: adapters folded into the weights
    info = ModelCardInfo(base_model=config.model.path, training_summary=summary, tags=(config.recipe,))
    directory = write_checkpoint(
        model,
        config.export.dir,
        place=replace_weights_in,
        tokenizer=tokenizer,
        max_shard_size=config.export.max_shard_size,
        model_card=info,
        model_id=config.export.push_to_hub,
    )
    if config.lora.rank and config.export.lora == "both":
        if dist.get_rank() == 0:
            shutil.rmtree(directory / "adapter", ignore_errors=True)  # an earlier export's adapter
            os.replace(adapter, directory / "adapter")
        dist.barrier()
    return _publish(config, directory)


def training_summary(config: RecipeConfig) -> dict[str, Any]:
    """What the model card reports of a run: the schedule, the data, the LoRA settings, and the layout keys set to
    other than their defaults (the strategy always; the pipeline's schedule keys only with a pipeline)."""
    defaults = LayoutSection()
    layout = {
        key: value
        for key, value in config.to_dict()["layout"].items()
        if key == "strategy" or (value != getattr(defaults, key) and (config.layout.pp_size > 1 or "pp_" not in key))
    }
    summary = {
        "recipe": config.recipe,
        "steps": config.train.max_steps,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.train.seq_len,
        "lr": config.train.lr,
        "layout": layout,
        "data": config.data.path,
    }
    if config.lora.rank:
        summary["lora"] = {"rank": config.lora.rank, "alpha": config.lora.alpha, "targets": config.lora.target_modules}
    return summary


def _export_adapter(model: nn.Module, directory: Path, tokenizer: Any) -> Path:
    """The adapter alone (as peft's save_pretrained writes it) and the tokenizer beside it, as peft users keep them."""
    from automodel.lora_checkpoint import save_lora_adapter

    directory = save_lora_adapter(model, directory)
    if tokenizer is not None and dist.get_rank() == 0:
        tokenizer.save_pretrained(directory)
    dist.barrier()
    return directory


def _publish(config: RecipeConfig, directory: Path) -> Path:
    if config.export.push_to_hub:
        publish(directory, config.export.push_to_hub)
    return directory
