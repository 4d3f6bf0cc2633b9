"""Block discovery without ``_no_split_modules``: the repeated blocks of the module tree (no ranks needed)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from automodel.distributed.model_structure import decoder_layers, repeated_blocks, tied_module_groups
from tests.tiny_models import build_model, tiny_llama_config


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        # A list inside a block (experts, per-head layers): nested in the block, so not a block of its own.
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(2)])


class Tower(nn.Module):
    """Two stacks of blocks, lists that are not blocks, and a plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([Block() for _ in range(2)])
        self.decoder = nn.ModuleList([Block() for _ in range(3)])
        # Two classes: not repeated blocks.
        self.mixed = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)), nn.ModuleDict({"proj": nn.Linear(4, 4)})])
        self.bare = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])  # layers, not blocks
        self.empty = nn.ModuleList([nn.Sequential(nn.Dropout()) for _ in range(2)])  # no parameters
        self.head = nn.Linear(4, 4)


def test_repeated_blocks_are_the_outermost_lists_of_one_block_class():
    tower = Tower()
    assert repeated_blocks(tower) == [*tower.encoder, *tower.decoder]


def test_decoder_layers_fall_back_to_repeated_blocks_and_say_so(caplog):
    model = build_model(tiny_llama_config())
    model._no_split_modules = []
    with caplog.at_level(logging.INFO, logger="automodel.distributed.model_structure"):
        assert decoder_layers(model) == list(model.model.layers)
        decoder_layers(model)  # logged once per model
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "LlamaForCausalLM declares no `_no_split_modules` blocks; using the repeated blocks of its module tree: "
        "model.layers (2 x LlamaDecoderLayer)"
    ]


def test_declared_blocks_win_and_undeclared_names_fall_back():
    model = build_model(tiny_llama_config())
    assert decoder_layers(model) == list(model.model.layers)
    model._no_split_modules = ["NotAClassOfThisModel"]
    assert decoder_layers(model) == list(model.model.layers)


def test_a_model_without_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Sequential declares no decoder layer classes .* no repeated blocks"):
        decoder_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_tied_module_groups_join_modules_sharing_a_parameter():
    first, second, alone = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    assert tied_module_groups([first, alone, second]) == [[first, second], [alone]]
    assert torch.equal(second.weight, first.weight)
