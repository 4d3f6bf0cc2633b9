"""The class a parallelized transformers model takes: its own, with ``save_pretrained`` and ``push_to_hub`` made
collective and consolidated.

transformers' ``save_pretrained`` cannot save a model whose parameters are shards (``DTensor``). ``parallelize``
gives the model a subclass of its class (as FSDP2 gives ``FSDP<Class>``), with the same name, whose ``save_pretrained``
and ``push_to_hub`` are called on every rank and write the checkpoint plain transformers would write for the whole
model, one gathered tensor at a time. The writing itself is checkpoint I/O, which lives in ``automodel.loading``; it
registers itself here (shared infrastructure never imports the loader).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

__all__ = ["CheckpointWriter", "ParallelizedModel", "adopt_parallelized_class", "register_checkpoint_writer"]


class CheckpointWriter(Protocol):
    """What ``automodel.loading`` registers: transformers' two methods, collective, for a parallelized model."""

    def save_pretrained(self, model: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> None: ...

    def push_to_hub(self, model: nn.Module, repo_id: str, **kwargs: Any) -> str: ...


_WRITER: list[CheckpointWriter] = []


def register_checkpoint_writer(writer: CheckpointWriter) -> None:
    """Make ``writer`` the implementation of ``save_pretrained`` / ``push_to_hub`` of parallelized models."""
    _WRITER[:] = [writer]


def _writer() -> CheckpointWriter:
    if not _WRITER:
        raise RuntimeError(
            "save_pretrained of a parallelized model writes a consolidated checkpoint with automodel's checkpoint "
            "writer, which is registered when automodel.loading is imported: `import automodel.loading` first (the "
            "auto classes and automodel's public names do), or call automodel.loading.save_hf_checkpoint(model, dir)."
        )
    return _WRITER[0]


class ParallelizedModel:
    """Mixed into a parallelized model's class: ``save_pretrained`` and ``push_to_hub`` are collective (call them on
    every rank) and write what transformers would write for the whole model."""

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """transformers' ``save_pretrained``, collective: rank 0 writes the consolidated checkpoint."""
        return _writer().save_pretrained(self, save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        """transformers' ``push_to_hub``, collective: the consolidated checkpoint, uploaded from rank 0."""
        return _writer().push_to_hub(self, repo_id, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, also of a plain (unsharded) state dict, such as plain transformers' model
        gives: collective where the model has sharded (``DTensor``) tensors, whose full values each rank then
        slices (torch's ``set_model_state_dict`` with ``full_state_dict=True``)."""
        own = nn.Module.state_dict(self)
        full = [name for name, value in state_dict.items() if isinstance(own.get(name), DTensor)]
        if not full or any(isinstance(state_dict[name], DTensor) for name in full):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(
            self, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``resize_token_embeddings`` where the embeddings are whole (DDP); refused where they are
        sharded (FSDP2, TP), which transformers' resizing cannot handle."""
        if any(isinstance(param, DTensor) for param in self.parameters()):
            raise NotImplementedError(
                "resize_token_embeddings of a model whose weights are sharded (FSDP2, TP) is not supported: resize "
                "before parallelizing (plain transformers: from_pretrained, resize_token_embeddings, save_pretrained), "
                "then load that checkpoint with the mesh."
            )
        return super().resize_token_embeddings(*args, **kwargs)


def adopt_parallelized_class(model: nn.Module) -> None:
    """Give a parallelized transformers model (or the model inside a strategy's wrapper) the subclass of its class
    with the collective ``save_pretrained`` / ``push_to_hub``; other modules (a diffusers model) keep their class."""
    inner = model if isinstance(model, PreTrainedModel) else getattr(model, "module", None)
    if not isinstance(inner, PreTrainedModel) or isinstance(inner, ParallelizedModel):
        return
    cls = type(inner)
    inner.__class__ = type(cls.__name__, (ParallelizedModel, cls), {"__module__": cls.__module__})
