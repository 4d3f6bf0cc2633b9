"""Compiled blocks (``MeshContext.build(compile=True)``, ``layout.compile: true``): each decoder block's forward is
``torch.compile``d (inductor; on CPU it generates C++) after TP and activation checkpointing, before FSDP2. Two
training steps give the losses and every gradient of the uncompiled model to 1e-4 (observed: <= 5e-7) under FSDP2,
FSDP2 x TP, TP + SP with selective AC, CP, DDP and a MoE model with full AC (routing decisions saved); module names are
unchanged; layouts where it cannot apply are refused by name.

Inductor compiles each block graph once per process (tens of seconds per rank group on these 2 cores, less with its
on-disk cache warm), hence ``slow``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from automodel.distributed import FSDP2Config, MegatronFSDPConfig, MeshContext
from automodel.distributed.compile import (
    CompileDecision,
    check_compile,
    compile_blocks,
    decide_compile,
    eager_block_classes,
)
from automodel.training.config import ConfigError, load_config
from tests.cases.compile import compiled_parity, pipelined_compiled_parity

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


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_blocks_inside_pipeline_stages(ranks2):
    """PP=2 with compiled blocks (each stage's blocks, after the stage split): the loss and every gradient of plain
    transformers, and of a batch of another length (new stage buffers)."""
    for rank, result in enumerate(ranks2.run(pipelined_compiled_parity, {"pp_size": 2}, timeout=900.0)):
        assert result["loss"] <= TOLERANCE and result["grad"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["other_shape_loss"] <= TOLERANCE and not result["no_grad"], result
        assert result["graphs"] >= 1, result


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


def test_auto_compiles_on_cuda_and_runs_eagerly_where_blocks_cannot_compile(monkeypatch):
    assert decide_compile(_context(compile="auto")) == CompileDecision(False, "auto, cpu")
    assert decide_compile(_context(compile="auto", device_type="cuda")) == CompileDecision(True, "auto, cuda")
    assert decide_compile(_context(compile=True)) == CompileDecision(True, "compile=True")
    assert decide_compile(_context(compile=False, device_type="cuda")) == CompileDecision(False, "compile=False")
    # Where an explicit compile=True is refused, auto runs the blocks eagerly and says why.
    expert = decide_compile(_context(compile="auto", device_type="cuda", ep_size=2))
    assert not expert.enabled and "eagerly: the expert all-to-all sends a data-dependent" in expert.why, expert
    megatron = decide_compile(_context(compile="auto", device_type="cuda", strategy=MegatronFSDPConfig()))
    assert not megatron.enabled and "Megatron-FSDP" in megatron.why, megatron
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    assert decide_compile(_context(compile="auto")) == CompileDecision(False, "auto, cpu")


def test_mesh_context_compile_argument():
    with pytest.raises(ValueError, match="compile='yes' must be 'auto', True or False"):
        MeshContext.build("fsdp2", compile="yes")


def _tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config), LlamaForCausalLM(config)


def test_a_block_class_that_fails_to_compile_runs_eagerly_said_once(caplog):
    """Inductor's C++ build fails (a compiler that does not exist): the blocks run their eager forward, the model's
    outputs are the uncompiled model's, and one warning names the block class and the reason."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    model, reference = _tiny_llama()
    reference.load_state_dict(model.state_dict())
    assert compile_blocks(model) == 2
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    # inductor's own patch, not monkeypatch: monkeypatch's undo of a config entry hides it for the rest of the process
    # (torch 2.11's torch.compile then fails reading the whole config).
    with inductor_config.patch({"cpp.cxx": ("no-such-compiler",)}):
        with caplog.at_level(logging.WARNING, logger="automodel.distributed.compile"):
            for _ in range(2):
                out = model(input_ids=tokens, labels=tokens, use_cache=False)
                out.loss.backward()
    expected = reference(input_ids=tokens, labels=tokens, use_cache=False)
    assert (out.logits - expected.logits).abs().max().item() == 0.0
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert "LlamaDecoderLayer blocks run eagerly (their compilation failed: InductorError" in warnings[0], warnings
    assert list(eager_block_classes(model)) == ["LlamaDecoderLayer"]
    torch._dynamo.reset()


def test_a_training_forward_with_a_kv_cache_runs_eagerly_and_says_so(caplog):
    """transformers creates a KV cache unless ``use_cache=False``: the blocks run eagerly (compiling them would
    recompile per layer), warned once; generation (no gradients) runs eagerly without a word."""
    torch._dynamo.reset()
    model, _ = _tiny_llama()
    compile_blocks(model)
    counters = torch._dynamo.utils.counters
    counters.clear()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="automodel.distributed.compile"):
        with torch.no_grad():
            model(input_ids=tokens)
        for _ in range(2):
            model(input_ids=tokens, labels=tokens).loss.backward()
    assert counters["stats"]["unique_graphs"] == 0
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "passed a KV cache to the LlamaDecoderLayer blocks" in warnings[0], warnings
    assert "use_cache=False" in warnings[0]
    assert eager_block_classes(model) == {}


@pytest.mark.slow
def test_variable_sequence_lengths_compile_twice_not_per_length():
    """50 training steps with 41 different sequence lengths: the blocks compile for the first shape, then once more
    with the length dynamic (dynamo's automatic dynamic shapes), and never again. A call with a KV cache runs
    eagerly (no compilation per layer)."""
    torch._dynamo.reset()
    model, _ = _tiny_llama(layers=4)
    compile_blocks(model)
    counters = torch._dynamo.utils.counters
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 97, (50,), generator=generator).tolist()
    graphs = []
    for length in lengths:
        tokens = torch.randint(0, 64, (2, length), generator=generator)
        model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(set(lengths)) > 30
    assert graphs[0] == 1 and graphs[-1] == 2, graphs  # all four blocks share each graph
    assert graphs.index(2) == 1 + lengths[1:].index(next(n for n in lengths[1:] if n != lengths[0])), graphs
    with torch.no_grad():
        model(input_ids=tokens[:, :4], use_cache=True)  # a KV cache: eager, no new graph
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_layout_compile_key(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("recipe: pretrain\nmodel: {path: m}\ndata: {path: d}\n")
    assert load_config(path).layout.compile == "auto"
    assert load_config(path, ["layout.compile=true"]).layout.compile is True
    assert load_config(path, ["layout.compile=false"]).layout.compile is False
    load_config(path, ["layout.ep_size=2"])  # auto runs expert-parallel blocks eagerly
    with pytest.raises(ConfigError, match="layout.compile=true compiles decoder blocks with layout.strategy=fsdp2"):
        load_config(path, ["layout.compile=true", "layout.ep_size=2"])


@pytest.mark.distributed
@pytest.mark.slow
def test_the_recipe_trains_the_same_with_compiled_blocks(ranks2, tmp_path):
    """SFT on packed chat data, FSDP2 over 2 ranks, with the fused loss: ``layout.compile=true`` follows the
    uncompiled run step by step."""
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint, train

    checkpoint = save_tiny_chat_checkpoint(tmp_path / "tiny_chat")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}, packing: true}}
train: {{max_steps: 3, global_batch_size: 4, micro_batch_size: 1, seq_len: 96, lr: 3.0e-3, loss: fused}}
"""
    )
    plain = ranks2.run(train, str(config), [])[0]["losses"]
    compiled = ranks2.run(train, str(config), ["layout.compile=true"], timeout=900.0)[0]["losses"]
    assert max(abs(a - b) for a, b in zip(plain, compiled, strict=True)) <= TOLERANCE, (plain, compiled)
