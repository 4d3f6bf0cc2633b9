"""``from_config``'s default init (module by module into the local shards, seeded per module): the same weights on
every layout and world size, with transformers' init distributions; ``init="exact"`` is tested in
``test_loading_parity.py``."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.auto_model import NeMoAutoModelForCausalLM
from automodel.loading.initialization import module_seed
from tests.cases.loading import from_config_weights
from tests.tiny_models import tiny_config

SEED = 1234

# (architecture, pool size, layout); the single-process weights are the reference.
LAYOUTS = [
    ("llama", 4, {"strategy": "fsdp2"}),
    ("llama", 4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    ("llama", 2, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama", 4, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama", 2, {"strategy": "ddp"}),
    ("llama_tied", 4, {"strategy": "fsdp2", "tp_size": 2}),
    ("llama_uneven", 4, {"strategy": "fsdp2"}),
    ("mixtral", 4, {"strategy": "fsdp2", "ep_size": 2}),
    ("mixtral", 4, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}),
    ("qwen3_moe", 4, {"strategy": "fsdp2", "ep_size": 4}),
    ("qwen3_moe", 2, {"strategy": "fsdp2", "tp_size": 2}),
]
LAYOUT_IDS = [
    "llama-fsdp2_dp4",
    "llama-hsdp_2x2",
    "llama-tp2",
    "llama-fsdp2_tp_2x2",
    "llama-ddp2",
    "llama_tied-fsdp2_tp_2x2",
    "llama_uneven-fsdp2_dp4",
    "mixtral-ep2",
    "mixtral-ep2_x_tp2",
    "qwen3_moe-ep4",
    "qwen3_moe-tp2",
]


@pytest.fixture(scope="module")
def one_process():
    """The default init in one process, per architecture (the reference of every layout)."""
    return {arch: from_config_weights(None, arch, SEED) for arch in {arch for arch, _, _ in LAYOUTS}}


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "world", "layout"), LAYOUTS, ids=LAYOUT_IDS)
def test_default_init_gives_the_same_weights_on_every_layout(request, one_process, arch, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    result = pool.run(from_config_weights, layout, arch, SEED)[0]
    reference = one_process[arch]["tensors"]
    assert result["on_meta"] == [] and (result["sharded"] > 0 or layout["strategy"] == "ddp"), result["on_meta"]
    assert sorted(result["tensors"]) == sorted(reference)
    different = [name for name, tensor in result["tensors"].items() if not torch.equal(tensor, reference[name])]
    assert different == [], f"{arch} {layout}: not identical to the one-process init: {different}"


def test_default_init_depends_on_the_seed_only():
    again = from_config_weights(None, "llama", SEED)["tensors"]
    assert all(torch.equal(t, again[n]) for n, t in from_config_weights(None, "llama", SEED)["tensors"].items())
    other = from_config_weights(None, "llama", SEED + 1)["tensors"]
    assert not torch.equal(again["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    # Each module draws from its own stream: two layers of the same shape get different weights.
    assert not torch.equal(again["model.layers.0.mlp.up_proj.weight"], again["model.layers.1.mlp.up_proj.weight"])
    assert module_seed(SEED, "model.layers.0.mlp.up_proj") != module_seed(SEED, "model.layers.1.mlp.up_proj")


def test_default_init_leaves_the_callers_generator_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=SEED)
    assert torch.equal(torch.rand(4), expected)


# Bigger than the layout tests' models, so that every weight matrix has thousands of samples.
DISTRIBUTION_SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, max_position_embeddings=128)


@pytest.mark.parametrize(
    "arch", ["llama_tied", "qwen3", "gemma3", "phi3", "gpt_neox", "mixtral", "qwen3_moe", "gpt_oss"]
)
def test_default_init_follows_transformers_init_distributions(arch):
    """Per parameter: constants (norm weights, biases) equal plain transformers' exactly; random ones have the same
    mean and standard deviation within 5 standard errors of the two samples."""
    sizes = {**DISTRIBUTION_SIZES, "head_dim": 32} if arch in ("qwen3", "gemma3", "qwen3_moe", "gpt_oss") else {}
    config = tiny_config(arch, **sizes)
    model = NeMoAutoModelForCausalLM.from_config(config, seed=SEED)
    torch.manual_seed(SEED)
    reference = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        ours, theirs = param.detach().double().flatten(), reference[name].detach().double().flatten()
        if theirs.numel() == 1 or theirs.std() == 0:
            assert torch.equal(ours, theirs), f"{arch} {name}: constant init differs"
            continue
        n = theirs.numel()
        variance = (ours.var() + theirs.var()).item()
        mean_error = 5 * math.sqrt(variance / n)
        std_error = 5 * math.sqrt(variance / (2 * n)) * 1.5  # 1.5: heavier tails than a normal's (e.g. uniform init)
        assert abs(ours.mean() - theirs.mean()).item() <= mean_error, (
            f"{arch} {name}: mean {ours.mean()} vs {theirs.mean()}"
        )
        assert abs(ours.std() - theirs.std()).item() <= std_error, f"{arch} {name}: std {ours.std()} vs {theirs.std()}"
        checked += 1
    assert checked >= 5, f"{arch}: only {checked} random parameters compared"


def test_unknown_init_mode_is_refused():
    with pytest.raises(ValueError, match=r"init='hf' is not an init mode: use one of \['per_module', 'exact'\]"):
        NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), init="hf")


def test_exact_init_without_a_mesh_is_plain_transformers():
    config = tiny_config("llama")
    model = NeMoAutoModelForCausalLM.from_config(config, seed=SEED, init="exact")
    torch.manual_seed(SEED)
    reference = AutoModelForCausalLM.from_config(config)
    assert all(torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())
