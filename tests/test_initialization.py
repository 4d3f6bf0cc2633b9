"""What the checkpoint does not hold gets the value plain transformers gives it, or a clear refusal: never the
uninitialised memory a meta-device build leaves behind.

Plain transformers computes non-persistent buffers (and initialises missing keys) after its own meta-device build by
running every module's ``_init_weights`` children first, so an ancestor's init has the last word; tiny models here
plant each way a model can rely on that: a buffer only the model-level init writes (Falcon-H1's ``mup_vector``), an
old-style ``.data`` write, a missing key the model says to ignore, and a buffer no init writes at all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from automodel import NeMoAutoModelForCausalLM
from automodel.loading.initialization import UninitializedTensorError
from tests.causal_lm_zoo import build_tiny_model, zoo_batch
from tests.parity import tensor_differences


class PlantedConfig(PretrainedConfig):
    model_type = "planted_init"

    def __init__(self, width: int = 8, old_style_init: bool = False, orphan_gets_init: bool = True, **kwargs):
        self.width = width
        self.old_style_init = old_style_init  # write weights through `.data`, as much remote code still does
        self.orphan_gets_init = orphan_gets_init
        super().__init__(**kwargs)


class Mixer(nn.Module):
    def __init__(self, config: PlantedConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.width, config.width)
        # Computed here, recomputed only by the model-level init (as FalconH1Mixer's mup_vector).
        self.register_buffer("scale", torch.ones(config.width), persistent=False)
        # Computed here and never by an init: after a meta-device build nothing gives it a value.
        self.register_buffer("orphan", torch.arange(config.width, dtype=torch.float32), persistent=False)
        self.register_buffer("step", torch.zeros(1), persistent=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden) * self.scale


class PlantedModel(PreTrainedModel):
    config_class = PlantedConfig
    _keys_to_ignore_on_load_missing = [r"\.step$"]

    def __init__(self, config: PlantedConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList([Mixer(config) for _ in range(2)])
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            if self.config.old_style_init:
                if not getattr(module.weight, "_is_hf_initialized", False):
                    module.weight.data.fill_(0.25)
            else:
                init.normal_(module.weight, std=0.5)
            init.zeros_(module.bias)
        elif isinstance(module, Mixer):
            init.constant_(module.step, 7.0)
            if self.config.orphan_gets_init:
                init.copy_(module.orphan, torch.arange(module.orphan.numel(), dtype=torch.float32))
        elif isinstance(module, PlantedModel):
            for index, layer in enumerate(module.layers):
                init.copy_(layer.scale, torch.full_like(layer.scale, 2.0 + index))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


AutoConfig.register(PlantedConfig.model_type, PlantedConfig)
AutoModelForCausalLM.register(PlantedConfig, PlantedModel)


def _save(tmp_path, drop: tuple[str, ...] = (), **options) -> str:
    torch.manual_seed(0)
    model = PlantedModel(PlantedConfig(**options))
    state = {name: tensor for name, tensor in model.state_dict().items() if not name.endswith(drop)}
    model.save_pretrained(tmp_path, state_dict=state)
    return str(tmp_path)


def _load_both(checkpoint: str, **ours) -> tuple[nn.Module, nn.Module]:
    """Plain transformers' model and ours (with the keywords ``ours``) of ``checkpoint``."""
    return PlantedModel.from_pretrained(checkpoint), NeMoAutoModelForCausalLM.from_pretrained(checkpoint, **ours)


def test_an_ancestors_init_computes_a_descendants_buffer(tmp_path):
    """The model-level init writes every layer's ``scale``. (Plain transformers skips the init of a module of code
    outside transformers that owns no tensor of its own, so its ``scale`` is uninitialised memory here; for the same
    model inside transformers, Falcon-H1 below, it computes the buffer and the two agree.)"""
    reference, ours = _load_both(_save(tmp_path))
    assert [layer.scale.tolist() for layer in ours.layers] == [[2.0] * 8, [3.0] * 8]
    assert tensor_differences(reference, ours) == ["layers.0.scale", "layers.1.scale"]


def test_an_old_style_data_write_counts_as_an_init(tmp_path):
    checkpoint = _save(tmp_path, drop=("layers.1.proj.weight",), old_style_init=True)
    reference, ours = _load_both(checkpoint, strict=False)
    assert bool((ours.layers[1].proj.weight == 0.25).all())
    assert tensor_differences(reference, ours) == ["layers.0.scale", "layers.1.scale"]  # as in the first test


def test_a_missing_key_the_model_ignores_still_gets_its_init(tmp_path):
    reference, ours = _load_both(_save(tmp_path, drop=(".step",)))
    assert [float(layer.step) for layer in ours.layers] == [7.0, 7.0]
    assert tensor_differences(reference, ours) == ["layers.0.scale", "layers.1.scale"]  # as in the first test


def test_a_buffer_no_init_writes_is_refused_by_name(tmp_path):
    checkpoint = _save(tmp_path, orphan_gets_init=False)
    with pytest.raises(UninitializedTensorError, match=r"layers\.0\.orphan, layers\.1\.orphan: no value"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint)


def test_falcon_h1_loads_with_transformers_loss(tmp_path):
    """The zoo model the defect was found on: its `mup_vector` (written only by FalconH1Model's init) was
    uninitialised memory after loading, and the loss NaN."""
    plain = build_tiny_model("falcon_h1", train=False)
    plain.save_pretrained(tmp_path)
    reference = type(plain).from_pretrained(tmp_path, dtype=torch.float32)
    ours = NeMoAutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert tensor_differences(reference, ours) == []
    batch = zoo_batch()
    with torch.no_grad():
        assert ours(input_ids=batch, labels=batch).loss == reference(input_ids=batch, labels=batch).loss
