"""``NeMoAutoModelForCausalLM.from_pretrained`` against plain transformers, for every architecture and layout.

Each tiny random checkpoint is written by ``save_pretrained`` in several shards (legacy per-expert keys for the MoE
models, which load through transformers' conversion mapping). Logits, loss and every gradient must agree within
1e-4 (fp32). The quick subset runs with ``-m "not slow"``; the whole matrix is marked ``slow``.
"""

from __future__ import annotations

import pytest

from tests.cases.loading import (
    bytes_read_per_rank,
    experts_finer_than_one_per_rank,
    from_config_matches_seed,
    loaded_parity,
    loaded_weights,
    plain_state_dict_and_resize,
)
from tests.cases.sidecar_nemotron_h import tiny_config as nemotron_h_config
from tests.causal_lm_zoo import tiny_config as zoo_tiny_config
from tests.tiny_models import ARCHITECTURES, build_model, save_tiny_checkpoint

TOLERANCE = 1e-4

LAYOUTS = {
    "fsdp2_dp4": (4, {"strategy": "fsdp2"}),
    "hsdp_2x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "fsdp2_tp_2x2": (4, {"strategy": "fsdp2", "tp_size": 2}),
    "ddp2": (2, {"strategy": "ddp"}),
}
# The unified MoE path, for the architectures with routed experts.
EP_LAYOUTS = {
    "ep2": (4, {"strategy": "fsdp2", "ep_size": 2}),
    "ep4": (4, {"strategy": "fsdp2", "ep_size": 4}),
    "ep2_x_tp2": (4, {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2}),
}
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")
QUICK = {
    ("llama", "fsdp2_dp4"),
    ("llama_tied", "fsdp2_tp_2x2"),
    ("llama_uneven", "fsdp2_tp_2x2"),
    ("mixtral", "tp2"),
    ("qwen3_moe", "hsdp_2x2"),
    ("mixtral", "ep2_x_tp2"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved checkpoint per architecture, shared by every layout."""
    return {arch: str(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))) for arch in ARCHITECTURES}


def _matrix():
    for arch in ARCHITECTURES:
        layouts = {**LAYOUTS, **EP_LAYOUTS} if arch in MOE_ARCHITECTURES else LAYOUTS
        for name, (world, layout) in layouts.items():
            marks = [pytest.mark.distributed] + ([] if (arch, name) in QUICK else [pytest.mark.slow])
            yield pytest.param(arch, world, layout, id=f"{arch}-{name}", marks=marks)


@pytest.mark.parametrize(("arch", "world", "layout"), _matrix())
def test_loaded_model_matches_plain_transformers(request, checkpoints, arch, world, layout):
    pool = request.getfixturevalue(f"ranks{world}")
    for rank, result in enumerate(pool.run(loaded_parity, checkpoints[arch], layout)):
        assert result["on_meta"] == [], result
        assert result["buffers"] == 0.0, result
        assert result["training"] is False
        assert result["same_class"] and result["n_grads"] == result["n_ref_grads"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, f"rank {rank}: {result}"
        if "tied" in result:
            assert result["tied"], "tied embeddings must stay one parameter"
        if layout["strategy"] != "ddp":
            assert result["sharded"] > 0


#: Two routed experts, top-1: under FSDP2 on 4 ranks, EP=2 (one local expert over ep_shard=2) and EP=2 x TP=2, fewer
#: local experts than the ranks that shard them.
TWO_EXPERTS = {
    "mixtral": {"num_local_experts": 2},
    "qwen3_moe": {"num_experts": 2},
    "olmoe": {"num_experts": 2},
    "gpt_oss": {"num_local_experts": 2},
    "qwen2_moe": {"num_experts": 2},  # with a shared expert
    "deepseek_v3": {"n_routed_experts": 2},  # multi-head latent attention, a dense first layer, a shared expert
    "nemotron_h": {"n_routed_experts": 2},  # its sidecar
}


def _save_two_experts(arch: str, directory) -> str:
    """A tiny checkpoint of ``arch`` with its ``TWO_EXPERTS`` overrides and one expert per token."""
    overrides = {**TWO_EXPERTS[arch], "num_experts_per_tok": 1}
    if arch in ARCHITECTURES:
        return str(save_tiny_checkpoint(arch, directory, **overrides))
    if arch == "nemotron_h":
        config = nemotron_h_config(**overrides)
    else:
        config = zoo_tiny_config(arch)
        for key, value in overrides.items():
            setattr(config, key, value)
    build_model(config).save_pretrained(directory, max_shard_size="40KB")
    return str(directory)


FINER_LAYOUTS = {
    "fsdp2_dp4": {"strategy": "fsdp2"},
    "ep2": {"strategy": "fsdp2", "ep_size": 2},
    "ep2_x_tp2": {"strategy": "fsdp2", "ep_size": 2, "tp_size": 2},
}


FINER_QUICK = {("mixtral", "fsdp2_dp4"), ("qwen3_moe", "ep2"), ("deepseek_v3", "ep2_x_tp2")}


def _finer_matrix():
    for arch in TWO_EXPERTS:
        for name in FINER_LAYOUTS:
            marks = [pytest.mark.distributed] + ([] if (arch, name) in FINER_QUICK else [pytest.mark.slow])
            yield pytest.param(arch, name, id=f"{arch}-{name}", marks=marks)


@pytest.mark.parametrize(("arch", "layout"), _finer_matrix())
def test_experts_split_finer_than_one_per_rank_match_plain_transformers(ranks4, tmp_path, arch, layout):
    """FSDP2 shards the experts' weights past their expert dim (dim 1) when the rank group is larger than the local
    experts, so each rank keeps a slice of every expert instead of a whole, padded one; the load reads those slices
    and the model matches plain transformers."""
    checkpoint = _save_two_experts(arch, tmp_path)
    for result in ranks4.run(experts_finer_than_one_per_rank, checkpoint, FINER_LAYOUTS[layout]):
        assert result["expert_shard_dims"] and 0 not in result["expert_shard_dims"], result
        assert max(result["logits"], result["loss"], result["grad"]) <= TOLERANCE, result
        assert not result["grad_presence"], result


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "gemma3", "mixtral"])
def test_without_mesh_context_it_is_plain_transformers(checkpoints, arch):
    result = loaded_parity(checkpoints[arch], None)
    assert result["logits"] == 0.0 and result["buffers"] == 0.0 and result["on_meta"] == [] and not result["training"]
    assert result.get("tied", True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("llama", {"strategy": "fsdp2"}),
        ("mixtral", {"strategy": "fsdp2"}),
        ("mixtral", {"strategy": "fsdp2", "ep_size": 2}),
        ("mixtral", {"strategy": "fsdp2", "ep_size": 4}),
    ],
    ids=["llama", "mixtral", "mixtral_ep2", "mixtral_ep4"],
)
def test_each_rank_reads_only_its_shards(ranks4, checkpoints, arch, layout):
    """Legacy per-expert keys too: with EP each rank reads only its own experts (and its FSDP shard of them)."""
    for result in ranks4.run(bytes_read_per_rank, checkpoints[arch], layout):
        # Each rank reads exactly what it stores (fp32 checkpoint into an fp32 model): a quarter of the total.
        assert result["read"] == result["local"], result
        assert result["read"] <= result["total"] / 4 * 1.05, result


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "layout", "arch"),
    [
        (4, {"strategy": "fsdp2"}, "llama"),
        (4, {"strategy": "fsdp2", "tp_size": 2}, "llama_tied"),
        (2, {"strategy": "fsdp2", "tp_size": 2}, "qwen3_moe"),
    ],
)
def test_from_config_exact_gives_the_weights_of_the_same_seed(request, world, layout, arch):
    """``init="exact"``: plain transformers' RNG stream, bit for bit, on every layout."""
    pool = request.getfixturevalue(f"ranks{world}")
    for result in pool.run(from_config_matches_seed, layout, arch, 1234):
        assert result["weights"] == 0.0 and result["buffers"] == 0.0, result


@pytest.mark.distributed
def test_registered_architecture_loads_as_its_sidecar_class(ranks2, checkpoints):
    from tests.cases.loading import registry_sidecar_is_used

    for result in ranks2.run(registry_sidecar_is_used, checkpoints["llama"]):
        assert "SidecarLlamaForCausalLM" in result["mro"], result
        assert result["units"].count("LlamaDecoderLayer") == 2 and result["units"][-1] == "SidecarLlamaForCausalLM"
        assert result["logits"] <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_weights_are_cast_while_copying_like_transformers(ranks4, checkpoints, dtype):
    import torch

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    layout = {"strategy": "fsdp2", "tp_size": 2}
    for result in ranks4.run(loaded_weights, checkpoints["llama_uneven"], layout, torch_dtype):
        assert result["max_diff"] == 0.0 and result["dtypes"] == result["reference"], result
        assert result["dtypes"] == (["torch.bfloat16"] if dtype == "bfloat16" else ["torch.float32"])


def test_transformers_argument_conventions(checkpoints):
    import torch

    from automodel import NeMoAutoModelForCausalLM

    with pytest.warns(FutureWarning, match="torch_dtype"):
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoints["llama"], torch_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model = NeMoAutoModelForCausalLM.from_pretrained(
        checkpoints["llama"], dtype="bfloat16", attn_implementation="eager"
    )
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='float33' is not a torch dtype"):
        NeMoAutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype="float33")


@pytest.mark.parametrize(
    "indices, runs",
    [
        ([], []),
        ([7], [(7, 8)]),
        ([0, 1, 2, 3], [(0, 4)]),
        ([0, 1, 2, 5, 6, 9], [(0, 3), (5, 7), (9, 10)]),
        ([4, 5, 0, 1], [(4, 6), (0, 2)]),  # local order, not sorted: a StridedShard's interleaving
        ([3, 3, 4], [(3, 4), (3, 5)]),
    ],
)
def test_index_runs_are_the_maximal_ascending_stretches_in_local_order(indices, runs):
    import torch

    from automodel.loading.placements import to_runs

    assert to_runs(torch.tensor(indices, dtype=torch.long)) == runs


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [{"strategy": "fsdp2"}, {"strategy": "fsdp2", "tp_size": 2}, {"strategy": "ddp"}],
    ids=["fsdp2", "tp2", "ddp"],
)
def test_a_plain_state_dict_loads_and_sharded_embeddings_are_not_resized(ranks2, checkpoints, layout):
    """As on plain transformers' model: ``load_state_dict`` takes full tensors (each rank keeps its slices), and
    ``resize_token_embeddings`` works where the embeddings are whole (DDP), else it says to resize before."""
    for result in ranks2.run(plain_state_dict_and_resize, checkpoints["llama"], layout):
        assert result["logits"] <= 1e-5, result
        if layout["strategy"] == "ddp":
            assert result["resize"] == "resized"
        else:
            assert "resize before parallelizing" in result["resize"], result
