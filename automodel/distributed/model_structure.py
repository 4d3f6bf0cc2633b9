"""Generic questions about a model's structure, answered from what transformers models declare or, failing that,
from the shape of the module tree.

Nothing here names an architecture: decoder layers are the modules whose class is in ``_no_split_modules`` (what
transformers itself uses as the unit that must not be split across devices) or, for models that declare none, the
repeated blocks of the module tree; embeddings come from ``get_input_embeddings`` / ``get_output_embeddings``, and
tied parameters are found by identity. A multimodal model's towers are told apart by ``get_decoder()`` (transformers'
accessor of the language model): blocks outside it belong to an encoder tower (a vision encoder's blocks).
"""

from __future__ import annotations

import logging
import weakref

from torch import nn

from .runtime import log_rank_zero

__all__ = [
    "attention_head_counts",
    "decoder_layers",
    "encoder_tower_blocks",
    "input_embeddings",
    "language_decoder",
    "output_embeddings",
    "repeated_blocks",
    "retie_parameters",
    "tied_module_groups",
    "tied_parameter_names",
]

logger = logging.getLogger(__name__)

# Models whose fallback block choice has been logged already (decoder_layers is asked once per step).
_REPORTED: weakref.WeakSet = weakref.WeakSet()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in module order: the units of FSDP and activation checkpointing.

    The modules whose class name is in ``_no_split_modules`` (or, for a diffusers model, ``_repeated_blocks``), each
    replaced by the repeated block holding it where it lies inside one (Idefics3 declares its vision encoder's
    attention, not the encoder layer around it); for a model that declares none (or none of whose declared classes occur in it), the members of its ``ModuleList`` s of
    one block class (:func:`repeated_blocks`), logged once. Raises a ``ValueError`` naming the class only when neither
    exists.
    """
    tree = _ModuleTree(model)
    declared = _declared_blocks(model, tree)
    if declared:
        return _lift_into_repeated_blocks(declared, tree)
    blocks = _repeated_blocks(tree)
    if not blocks:
        names = sorted(getattr(model, "_no_split_modules", None) or ())
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer classes in `_no_split_modules` ({names or 'empty'}) "
            "and has no repeated blocks (an nn.ModuleList of modules of one class that hold parameters), so the "
            "shared FSDP / activation-checkpointing traversal cannot find its blocks. Set `_no_split_modules` on the "
            "model class, or override `_apply_fsdp_sharding` in a sidecar."
        )
    if model not in _REPORTED:
        _REPORTED.add(model)
        log_rank_zero(
            logger,
            "%s declares no `_no_split_modules` blocks; using the repeated blocks of its module tree: %s",
            type(model).__name__,
            _describe_blocks(model, blocks),
        )
    return blocks


class _ModuleTree:
    """A model's modules in ``modules()`` order (each once, pre-order), with every module's parents (all of them, for
    a module shared by several), walked once with a stack. ``modules()`` yields through one generator per level of
    the tree, and :func:`decoder_layers` is asked several times per ``parallelize`` and once per step: about 1.1 ms a
    time for a 15-layer Llama, 0.35 ms this way."""

    def __init__(self, root: nn.Module) -> None:
        self.modules: list[nn.Module] = []
        self.parents: dict[int, list[nn.Module]] = {}
        seen: set[int] = set()
        stack = [root]
        while stack:
            module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            self.modules.append(module)
            children = [child for child in module._modules.values() if child is not None]
            for child in children:
                self.parents.setdefault(id(child), []).append(module)
            stack.extend(reversed(children))

    def outermost(self, candidates: list[nn.Module]) -> list[nn.Module]:
        """``candidates`` (modules of this tree) each once, without those nested inside another of them (an encoder
        layer inside a decoder layer of the same family, the experts list inside a block)."""
        candidates = list(dict.fromkeys(candidates))
        chosen = {id(module) for module in candidates}
        return [module for module in candidates if not self._inside(module, chosen)]

    def _inside(self, module: nn.Module, chosen: set[int]) -> bool:
        """Whether a strict ancestor of ``module`` (through any of its parents) is in ``chosen``."""
        stack, seen = list(self.parents.get(id(module), ())), set()
        while stack:
            parent = stack.pop()
            if id(parent) in chosen:
                return True
            if id(parent) not in seen:
                seen.add(id(parent))
                stack.extend(self.parents.get(id(parent), ()))
        return False


def _declared_blocks(model: nn.Module, tree: _ModuleTree) -> list[nn.Module]:
    """The blocks of the classes the model declares: transformers' ``_no_split_modules``, else diffusers'
    ``_repeated_blocks`` (the block classes it compiles regionally)."""
    names = set(getattr(model, "_no_split_modules", None) or getattr(model, "_repeated_blocks", None) or ())
    if not names:
        return []
    # By class name, as transformers matches them; through the MRO, so that a block FSDP2 has wrapped (its class
    # becomes a subclass, FSDPLlamaDecoderLayer) or a sidecar subclasses is still found.
    declared: dict[type, bool] = {}
    layers = []
    for module in tree.modules[1:]:  # not the model itself
        cls = type(module)
        if cls not in declared:
            declared[cls] = any(base.__name__ in names for base in cls.__mro__)
        if declared[cls]:
            layers.append(module)
    return tree.outermost(layers)


def _lift_into_repeated_blocks(declared: list[nn.Module], tree: _ModuleTree) -> list[nn.Module]:
    """``declared`` with each module that lies inside a repeated block replaced by that block, in module order."""
    blocks = _repeated_blocks(tree)
    position = {id(block): index for index, block in enumerate(blocks)}

    def holder(module: nn.Module) -> nn.Module:
        # The last repeated block the module is or lies inside (one shared by several blocks lies in each), else the
        # module itself.
        found, stack, seen = [], [module], set()
        while stack:
            current = stack.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            if id(current) in position:
                found.append(current)
            stack.extend(tree.parents.get(id(current), ()))
        return max(found, key=lambda block: position[id(block)]) if found else module

    lifted = [holder(module) for module in declared]
    order = {id(module): index for index, module in enumerate(tree.modules)}
    return sorted(tree.outermost(lifted), key=lambda module: order[id(module)])


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of every ``nn.ModuleList`` whose children are all of one class, each holding parameters and
    submodules of its own (a block, not a bare layer), outermost only, in module order.

    A pipeline stage's stand-ins for the layers other stages run (``absent_from_stage``) are not members: the stage's
    own layers are its blocks."""
    return _repeated_blocks(_ModuleTree(model))


def _repeated_blocks(tree: _ModuleTree) -> list[nn.Module]:
    """:func:`repeated_blocks` of the model ``tree`` was walked from."""
    blocks: list[nn.Module] = []
    for module in tree.modules:
        if not isinstance(module, nn.ModuleList):
            continue
        children = [child for child in module if not getattr(child, "absent_from_stage", False)]
        if not children or len({type(child) for child in children}) != 1:
            continue
        if all(_is_block(child) for child in children):
            blocks.extend(children)
    return tree.outermost(blocks)


def _is_block(module: nn.Module) -> bool:
    has_parameters = next(module.parameters(), None) is not None
    return has_parameters and next(module.children(), None) is not None


def _describe_blocks(model: nn.Module, blocks: list[nn.Module]) -> str:
    """``"model.layers (2 x LlamaDecoderLayer), ..."``: each container with its block count and class."""
    names = {module: name for name, module in model.named_modules()}
    groups: dict[str, list[nn.Module]] = {}
    for block in blocks:
        container = names[block].rpartition(".")[0] or "<root>"
        groups.setdefault(container, []).append(block)
    return ", ".join(f"{name} ({len(members)} x {type(members[0]).__name__})" for name, members in groups.items())


def language_decoder(model: nn.Module) -> nn.Module | None:
    """The language model (transformers' ``get_decoder()``: the text decoder of a vision-language model, the base
    model of a causal LM), or ``None`` for models without the accessor."""
    getter = getattr(model, "get_decoder", None)
    try:
        decoder = getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None
    return decoder if isinstance(decoder, nn.Module) else None


def encoder_tower_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks (:func:`decoder_layers`) outside the language decoder: a vision-language model's vision encoder
    blocks (and those of any other encoder tower). Empty for a single-tower model."""
    decoder = language_decoder(model)
    if decoder is None or decoder is model:
        return []
    inside = {id(module) for module in decoder.modules()}
    return [block for block in decoder_layers(model) if id(block) not in inside]


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The token embedding module, or ``None`` for models without one."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The output head (``lm_head``), or ``None`` for models without one."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one ``Parameter`` object (e.g. tied embeddings and ``lm_head``)."""
    by_identity: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def tied_module_groups(modules: list[nn.Module]) -> list[list[nn.Module]]:
    """``modules`` grouped with every other of them they share a parameter with (twin layers), in the order of each
    group's first member. FSDP2 shards a parameter in one unit only, so such a group must be one unit."""
    groups: list[tuple[list[nn.Module], set[int]]] = []
    for module in modules:
        params = {id(param) for param in module.parameters()}
        touching = [group for group in groups if group[1] & params]
        members = [member for group in touching for member in group[0]] + [module]
        shared = params.union(*(group[1] for group in touching))
        groups = [group for group in groups if all(group is not other for other in touching)]
        groups.append((members, shared))
    return sorted((members for members, _ in groups), key=lambda members: modules.index(members[0]))


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


def attention_head_counts(model: nn.Module) -> dict[str, int]:
    """The config's ``num_attention_heads`` and ``num_key_value_heads`` (the latter defaulting to the former), of the
    text config for a multimodal model; empty without a config or head counts."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    counts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return {label: count for label, count in counts.items() if isinstance(count, int)}
