"""Generic questions about a model's structure, answered from what transformers models declare.

Nothing here names an architecture: decoder layers are the modules whose class is in ``_no_split_modules`` (what
transformers itself uses as the unit that must not be split across devices), embeddings come from
``get_input_embeddings`` / ``get_output_embeddings``, and tied parameters are found by identity.
"""

from __future__ import annotations

from torch import nn

__all__ = ["decoder_layers", "input_embeddings", "output_embeddings", "retie_parameters", "tied_parameter_names"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in forward order: modules whose class name is in ``_no_split_modules``.

    Raises a ``ValueError`` naming the class when the model declares none (a sidecar can then override the FSDP and
    activation-checkpointing hooks).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if module is not model and type(module).__name__ in names]
    # A block class may nest (e.g. an encoder layer inside a decoder layer of the same family): keep the outermost.
    nested = {id(inner) for layer in layers for inner in layer.modules() if inner is not layer}
    layers = [layer for layer in layers if id(layer) not in nested]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer classes in `_no_split_modules` "
            f"({sorted(names) or 'empty'}), so the shared FSDP / activation-checkpointing traversal cannot find its "
            "blocks. Set `_no_split_modules` on the model class or override `_apply_fsdp_sharding` in a sidecar."
        )
    return layers


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The token embedding module, or ``None`` for models without one."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if getter is not None else None
    except NotImplementedError:
        return None


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The output head (``lm_head``), or ``None`` for models without one."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if getter is not None else None
    except NotImplementedError:
        return None


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one ``Parameter`` object (e.g. tied embeddings and ``lm_head``)."""
    by_identity: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def retie_parameters(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group point at the group's first parameter again.

    Sharding replaces a module's ``Parameter`` object, which silently unties the other names of the group; this
    restores the single shared parameter. The placements must already agree, which the caller checks.
    """
    for names in groups:
        source = model.get_parameter(names[0])
        for name in names[1:]:
            module_name, _, param_name = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[param_name] = source
