"""``train.loss: fused``: the head and the cross-entropy over token chunks, with each chunk's gradients computed in
the forward, give the loss and every gradient of the model's own loss (packed batches, uneven chunks, gradient
accumulation) on one process and under FSDP2, HSDP, TP (vocabulary-sharded head), SP, CP (``shift_labels``), FSDP2 x
TP, EP and DDP, for tied and untied heads and with the logit transforms of Gemma, Cohere and Granite; the matrix
products run in the inputs' dtype and nothing in the loss waits on the device; unsupported models are refused by
name."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.training.config import ConfigError, load_config
from automodel.training.linear_cross_entropy import LogitTransform, fused_linear_cross_entropy
from automodel.training.loss import (
    FusedLinearCrossEntropy,
    ModelLoss,
    check_fused_loss_support,
    choose_loss,
    make_loss,
)
from tests.cases.loss import fused_loss_parity
from tests.tiny_models import _DENSE, VOCAB, build_model, tiny_config, token_batch

TOLERANCE = 1e-5
SOFTCAP = {"final_logit_softcapping": 0.5}  # small: most logits are actually capped

LAYOUTS = [
    ("llama", 4, {"strategy": "fsdp2"}, {}),
    ("llama", 2, {"strategy": "fsdp2"}, {}),
    ("llama_tied", 2, {"strategy": "fsdp2"}, {}),
    ("llama_tied", 4, {"strategy": "fsdp2", "dp_replicate_size": 2}, {}),
    ("llama", 2, {"strategy": "fsdp2", "tp_size": 2}, {}),
    ("llama_tied", 2, {"strategy": "fsdp2", "tp_size": 2}, {}),
    ("llama", 2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}, {}),
    ("llama", 2, {"strategy": "fsdp2", "cp_size": 2}, {}),
    ("llama", 4, {"strategy": "fsdp2", "tp_size": 2}, {}),
    ("llama", 4, {"strategy": "fsdp2", "cp_size": 2, "tp_size": 2}, {}),
    ("mixtral", 4, {"strategy": "fsdp2", "ep_size": 2}, {}),
    ("llama", 2, {"strategy": "ddp"}, {}),
    ("gemma3", 2, {"strategy": "fsdp2"}, SOFTCAP),
    ("gemma3", 2, {"strategy": "fsdp2", "tp_size": 2}, SOFTCAP),
    ("gemma3", 2, {"strategy": "fsdp2", "cp_size": 2}, {**SOFTCAP, "layer_types": ["full_attention"] * 2}),
]
IDS = [
    "fsdp2_dp4",
    "fsdp2_dp2",
    "tied-fsdp2_dp2",
    "tied-hsdp_2x2",
    "tp2",
    "tied-tp2",
    "tp2_sp",
    "cp2",
    "fsdp2_tp_2x2",
    "cp2_x_tp2",
    "mixtral-ep2",
    "ddp2",
    "softcap-fsdp2_dp2",
    "softcap-tp2",
    "softcap-cp2",
]


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "world", "layout", "config"), LAYOUTS, ids=IDS)
def test_fused_loss_equals_the_model_loss(request, arch, world, layout, config):
    pool = request.getfixturevalue(f"ranks{world}")
    for rank, result in enumerate(pool.run(fused_loss_parity, layout, arch, **config)):
        assert result["micro_batches"] > 1, result  # gradient accumulation on every layout
        assert result["loss_difference"] <= TOLERANCE and result["grad"] <= TOLERANCE, f"rank {rank}: {result}"
        assert result["head_grad_norm"] > 0, result
        assert result["logits_shape"] == (*result["input_shape"], VOCAB), result
        if layout.get("tp_size", 1) > 1:
            assert "Shard(dim=0)" in result["head_placements"], f"the head's vocabulary is not TP-sharded: {result}"


def _dense_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**_DENSE, "attn_implementation": "sdpa", **overrides})


MODELS = {
    "llama": lambda: tiny_config("llama"),
    "tied": lambda: tiny_config("llama_tied"),
    "gemma3-softcap": lambda: tiny_config("gemma3", **SOFTCAP),
    "cohere-logit_scale": lambda: _dense_config("cohere", logit_scale=0.3, pad_token_id=0, eos_token_id=1),
    "granite-logits_scaling": lambda: _dense_config("granite", logits_scaling=3.0),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_one_process_the_loss_and_every_gradient_equal_the_model_loss(name):
    """Ignored prompt tokens, every chunk size (one row, uneven, one chunk), two accumulated micro batches."""
    config = MODELS[name]()
    batches = [token_batch(2, 16, seed=seed) for seed in (1, 2)]
    labels = [batch.masked_fill(torch.arange(16) < 5, -100) for batch in batches]
    micro_batches = [{"input_ids": batch, "labels": label} for batch, label in zip(batches, labels, strict=True)]
    count = torch.tensor(float(sum(int((label[:, 1:] != -100).sum()) for label in labels)))
    reference = build_model(config)
    losses = [ModelLoss()(reference, inputs, count) for inputs in micro_batches]
    sum(losses).backward()
    for chunk in (1, 7, 10_000):
        model = build_model(config)
        fused = FusedLinearCrossEntropy(chunk)
        ours = [fused(model, inputs, count) for inputs in micro_batches]
        for loss in ours:
            loss.backward()
        assert abs(sum(ours).item() - sum(losses).item()) <= TOLERANCE, (name, chunk)
        expected = dict(reference.named_parameters())
        for param_name, param in model.named_parameters():
            difference = (param.grad - expected[param_name].grad).abs().max().item()
            assert difference <= TOLERANCE, (name, chunk, param_name, difference)
    # Without a token count it is the mean over the valid tokens, as the model's own loss.
    mean = FusedLinearCrossEntropy(8)(model, {"input_ids": batches[0], "labels": labels[0]}, None)
    assert (mean - reference(input_ids=batches[0], labels=labels[0]).loss).abs().item() <= TOLERANCE


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=2.0), LogitTransform(divide=3.0)])
def test_a_head_with_a_bias_and_shifted_labels(transform):
    """The function itself against autograd through the full logits: bias, ignored targets, scaled incoming gradient."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(21, 8, generator=generator, requires_grad=True)
    weight = torch.randn(33, 8, generator=generator, requires_grad=True)
    bias = torch.randn(33, generator=generator, requires_grad=True)
    targets = torch.randint(0, 33, (21,), generator=generator).masked_fill(torch.arange(21) % 4 == 0, -100)
    scale = torch.tensor(1 / 7)
    logits = functional.linear(hidden, weight, bias)
    logits = logits / transform.divide if transform.divide else logits
    logits = torch.tanh(logits / transform.softcap) * transform.softcap if transform.softcap else logits
    expected = functional.cross_entropy(logits, targets, reduction="sum") * scale
    expected_grads = torch.autograd.grad(expected * 3, (hidden, weight, bias))
    loss = fused_linear_cross_entropy(hidden, weight, bias, targets, scale, chunk_size=4, transform=transform)
    grads = torch.autograd.grad(loss * 3, (hidden, weight, bias))
    assert (loss - expected).abs().item() <= TOLERANCE
    for ours, theirs in zip(grads, expected_grads, strict=True):
        assert (ours - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_chunk_equals_the_eager_chunks(dtype):
    """The path CUDA takes by default (each chunk's softmax, loss and logit gradient one ``torch.compile``d function;
    inductor's C++ here): the loss and both gradients of the eager chunks, for each logit transform, ignored targets,
    an uneven last chunk (the length turns dynamic) and a bias."""
    torch.compiler.reset()
    generator = torch.Generator().manual_seed(0)
    for transform in (LogitTransform(), LogitTransform(softcap=2.0), LogitTransform(multiply=0.5)):
        hidden = torch.randn(37, 16, generator=generator).to(dtype)
        weight = torch.randn(50, 16, generator=generator).to(dtype)
        bias = torch.randn(50, generator=generator).to(dtype)
        targets = torch.randint(0, 50, (37,), generator=generator).masked_fill(torch.arange(37) % 5 == 0, -100)
        results = []
        for compiled in (False, True):
            inputs = [tensor.clone().requires_grad_() for tensor in (hidden, weight, bias)]
            loss = fused_linear_cross_entropy(
                *inputs, targets, torch.tensor(1 / 30), chunk_size=8, transform=transform, compiled=compiled
            )
            loss.backward()
            results.append([loss.detach(), *(tensor.grad for tensor in inputs)])
        for eager, compiled in zip(*results, strict=True):
            assert (eager.float() - compiled.float()).abs().max().item() <= TOLERANCE, transform
    torch.compiler.reset()


class _RecordOps(TorchDispatchMode):
    """Records every aten op with the dtypes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = tuple(arg.dtype for arg in args if isinstance(arg, torch.Tensor))
        self.ops.append((func.__name__, dtypes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk", [5, 1000])
def test_bf16_matrix_products_stay_bf16_and_nothing_waits_on_the_device(chunk):
    """Every matrix product of a bf16 head runs on bf16 inputs (tensor cores on a GPU); no op in the forward or the
    backward reads a value back to the host (``nonzero``, ``item``, boolean indexing)."""
    hidden = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (40,)).masked_fill(torch.arange(40) < 9, -100)
    with _RecordOps() as recorded:
        loss = fused_linear_cross_entropy(hidden, weight, None, targets, torch.tensor(0.1), chunk_size=chunk)
        loss.backward()
    products = [dtypes for name, dtypes in recorded.ops if name.split(".")[0] in ("mm", "addmm", "linear", "matmul")]
    assert products and all(set(dtypes) == {torch.bfloat16} for dtypes in products), products
    host_reads = {"nonzero", "_local_scalar_dense", "masked_select", "item", "index_put_", "index"}
    assert not [name for name, _ in recorded.ops if name.split(".")[0] in host_reads], recorded.ops
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_without_gradients_it_computes_only_the_loss():
    model = build_model(tiny_config("llama"))
    batch = token_batch(2, 8)
    with torch.no_grad():
        loss = FusedLinearCrossEntropy(4)(model, {"input_ids": batch, "labels": batch}, None)
    assert not loss.requires_grad and (loss - model(input_ids=batch, labels=batch).loss).abs() <= TOLERANCE


def test_what_cannot_be_exact_is_refused():
    assert check_fused_loss_support(build_model(tiny_config("gemma3", **SOFTCAP))) == LogitTransform(softcap=0.5)
    config = tiny_config("mixtral", output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=True.*adds a loss term.*Use train.loss=model"):
        check_fused_loss_support(AutoModelForCausalLM.from_config(config))
    config = _dense_config("granite", logits_scaling=3.0, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="logits_scaling=3.0, final_logit_softcapping=30.0.*order"):
        check_fused_loss_support(AutoModelForCausalLM.from_config(config))
    model = build_model(tiny_config("llama"))
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="output embeddings are Sequential.*Use train.loss=model"):
        check_fused_loss_support(model)


def test_config_keys(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("recipe: pretrain\nmodel: {path: m}\ndata: {path: d}\n")
    default = load_config(path)
    assert default.train.loss == "auto" and isinstance(make_loss("model", 1024), ModelLoss)
    assert default.train.loss_chunk_size == 4096
    fused = load_config(path, ["train.loss=fused", "train.loss_chunk_size=2048"])
    assert make_loss(fused.train.loss, fused.train.loss_chunk_size) == FusedLinearCrossEntropy(2048)
    old = load_config(path, ["train.loss=chunked"])
    with pytest.warns(FutureWarning, match="train.loss=chunked is now train.loss=fused"):
        assert make_loss(old.train.loss, 16) == FusedLinearCrossEntropy(16)
    with pytest.raises(ValueError, match="Unknown loss 'liger': use 'model' or 'fused'"):
        make_loss("liger", 16)
    with pytest.raises(ConfigError, match="train.loss='liger' is not one of"):
        load_config(path, ["train.loss=liger"])
    with pytest.raises(ConfigError, match="train.loss_chunk_size=0 must be at least 1"):
        load_config(path, ["train.loss_chunk_size=0"])
    with pytest.raises(ConfigError, match="train.loss=fused runs with layout.strategy=fsdp2 or ddp"):
        load_config(path, ["train.loss=fused", "layout.strategy=megatron_fsdp"])


def test_auto_is_the_fused_loss_where_it_is_exact_else_the_model_loss():
    """``train.loss: auto`` (the default): the fused loss for a plain linear head, the model's own loss (with the
    reason in the log line) where the fused one cannot be exact or the layout rules it out."""
    model = build_model(tiny_config("llama"))
    loss, line = choose_loss("auto", 256, model)
    assert loss == FusedLinearCrossEntropy(256) and line == "loss: fused (auto), chunks of 256 tokens"
    loss, line = choose_loss("auto", 256, model, fused_refusal="the fused loss runs with fsdp2 or ddp")
    assert loss == ModelLoss() and "auto; the fused loss is not exact here: the fused loss runs with fsdp2" in line
    routed = build_model(tiny_config("llama"))
    routed.config.output_router_logits = True
    loss, line = choose_loss("auto", 256, routed)
    assert loss == ModelLoss() and "output_router_logits=True" in line, line
    assert choose_loss("model", 256, model) == (ModelLoss(), "loss: model")


@pytest.mark.distributed
def test_the_recipe_trains_the_same_with_the_fused_loss(ranks2, tmp_path):
    """SFT on packed chat data, FSDP2 over 2 ranks: ``train.loss=fused`` follows the model loss step by step."""
    from tests.cases.training import CHAT_DATA, save_tiny_chat_checkpoint, train

    checkpoint = save_tiny_chat_checkpoint(tmp_path / "tiny_chat")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"""
recipe: sft
model: {{path: {checkpoint}}}
data: {{path: {CHAT_DATA}, packing: true}}
train: {{max_steps: 4, global_batch_size: 4, micro_batch_size: 1, seq_len: 96, lr: 3.0e-3}}
"""
    )
    plain = ranks2.run(train, str(config), [])[0]["losses"]
    fused = ranks2.run(train, str(config), ["train.loss=fused", "train.loss_chunk_size=16"])[0]["losses"]
    assert abs(plain[0] - fused[0]) <= TOLERANCE, (plain, fused)
    # Later steps start from weights updated with gradients equal to ~1e-8: the losses stay within 1e-4.
    assert max(abs(a - b) for a, b in zip(plain, fused, strict=True)) <= 1e-4, (plain, fused)
