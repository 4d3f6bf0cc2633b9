"""Compiled blocks (``MeshContext.build(compile=True)``, ``layout.compile: true``): each decoder block's forward is
``torch.compile``d (inductor; on CPU it generates C++) after TP and activation checkpointing, before FSDP2. Two
training steps give the losses and every gradient of the uncompiled model to 1e-4 (observed: <= 5e-7) under FSDP2,
FSDP2 x TP, TP + SP with selective AC, CP, DDP and a MoE model with full AC (routing decisions saved); module names are
unchanged; layouts where it cannot apply are refused by name.

Inductor compiles each block graph once per process (tens of seconds per rank group on these 2 cores, less with its
on-disk cache warm), hence ``slow``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from automodel.distributed import FSDP2Config, MegatronFSDPConfig
from automodel.distributed.compile import check_compile
from automodel.training.config import ConfigError, load_config
from tests.cases.compile import compiled_parity

TOLERANCE = 1e-4

LAYOUTS = [
    ("llama", 2, {"strategy": "fsdp2"}),
    ("llama", 4, {"strategy": "fsdp2", "tp_size": 2}),
    (
        "llama",
        2,
        {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True, "activation_checkpointing": "selective"},
    ),
    ("mixtral", 2, {"strategy": "fsdp2", "activation_checkpointing": "full"}),
    ("llama", 2, {"strategy": "fsdp2", "cp_size": 2}),
    ("llama", 2, {"strategy": "ddp"}),
]
IDS = ["fsdp2_dp2", "fsdp2_tp_2x2", "tp2_sp-selective_ac", "mixtral-fsdp2-full_ac", "cp2", "ddp2"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("arch", "world", "layout"), LAYOUTS, ids=IDS)
def test_compiled_blocks_train_as_the_uncompiled_model(request, arch, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    for rank, result in enumerate(pool.run(compiled_parity, layout, arch, timeout=900.0)):
        assert result["loss"] <= TOLERANCE and result["grad"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["compiled_blocks"] == result["blocks"] == 2, result
        assert result["names_kept"], result
        # After the first forward's one-shot checks, the blocks run as whole graphs.
        assert not result["steady_graph_breaks"], result


def _context(**fields):
    defaults = {"ep_size": 1, "strategy": FSDP2Config(), "device_type": "cpu", "compile": True}
    return SimpleNamespace(**{**defaults, **fields})


def test_compile_is_refused_where_it_cannot_apply(monkeypatch):
    with pytest.raises(ValueError, match="compile=True with ep_size=2 is not supported.*Use compile=False"):
        check_compile(_context(ep_size=2))
    with pytest.raises(ValueError, match="strategy='megatron_fsdp' is not supported"):
        check_compile(_context(strategy=MegatronFSDPConfig()))
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match=r"needs a compiler.*\(g\+\+, c\+\+, clang\+\+ or \$CXX\)"):
        check_compile(_context())
    check_compile(_context(device_type="cuda"))  # the GPU backend generates Triton, not C++


def test_layout_compile_key(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("recipe: pretrain\nmodel: {path: m}\ndata: {path: d}\n")
    assert load_config(path).layout.compile is False
    assert load_config(path, ["layout.compile=true"]).layout.compile is True
    with pytest.raises(ConfigError, match="layout.compile=true compiles decoder blocks with layout.strategy=fsdp2"):
        load_config(path, ["layout.compile=true", "layout.ep_size=2"])


@pytest.mark.distributed
@pytest.mark.slow
def test_the_recipe_trains_the_same_with_compiled_blocks(ranks2, tmp_path):
    """SFT on packed chat data, FSDP2 over 2 ranks, with the chunked loss: ``layout.compile=true`` follows the
    uncompiled run step by step."""
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint, train

    checkpoint = save_tiny_chat_checkpoint(tmp_path / "tiny_chat")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}, packing: true}}
train: {{max_steps: 3, global_batch_size: 4, micro_batch_size: 1, seq_len: 96, lr: 3.0e-3, loss: chunked}}
"""
    )
    plain = ranks2.run(train, str(config), [])[0]["losses"]
    compiled = ranks2.run(train, str(config), ["layout.compile=true"], timeout=900.0)[0]["losses"]
    assert max(abs(a - b) for a, b in zip(plain, compiled, strict=True)) <= TOLERANCE, (plain, compiled)
