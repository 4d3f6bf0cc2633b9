"""The seam for private torch / transformers symbols (``automodel._compat``) and the tested version range.

The range is declared in three places that must agree: ``pyproject.toml`` (what pip allows), the Makefile's
``OLDEST_VERSIONS`` / ``NEWEST_VERSIONS`` (what ``make test-compat`` runs) and ``TESTED_RANGES`` (what a missing
symbol's error message tells the user to install).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import re
from pathlib import Path

import pytest
import tomllib
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

import automodel._compat.torch as compat_torch
import automodel._compat.transformers as compat_transformers
from automodel._compat import TESTED_RANGES, MissingSymbolError, private_symbol

REPO = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, str]:
    """``{"torch": ">=2.11.0,<2.15", ...}`` from pyproject.toml's dependencies."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pairs = (re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", dependency).groups() for dependency in dependencies)
    return {name: specifier for name, specifier in pairs if name in TESTED_RANGES}


def _make_pins(variable: str) -> dict[str, str]:
    """``{"torch": "2.11.0", "transformers": "5.23.0"}`` from a Makefile line ``VARIABLE := torch==... ...``."""
    line = re.search(rf"^{variable} := (.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert line, f"{variable} is missing from the Makefile"
    return dict(pin.split("==") for pin in line.group(1).split())


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group(0).split("."))


def _within(version: str, specifier: str) -> bool:
    lower, upper = re.fullmatch(r">=([\d.]+),<([\d.]+)", specifier).groups()
    return _version(lower) <= _version(version) < _version(upper)


def test_pyproject_declares_exactly_the_tested_range() -> None:
    assert _declared() == {name: tested.specifier for name, tested in TESTED_RANGES.items()}
    for tested in TESTED_RANGES.values():
        assert tested.specifier.startswith(f">={tested.oldest},"), "the range starts at the oldest tested release"
        assert _within(tested.newest, tested.specifier)


def test_make_test_compat_runs_both_ends_of_the_range() -> None:
    assert _make_pins("OLDEST_VERSIONS") == {name: tested.oldest for name, tested in TESTED_RANGES.items()}
    assert _make_pins("NEWEST_VERSIONS") == {name: tested.newest for name, tested in TESTED_RANGES.items()}
    default = _make_pins("DEFAULT_VERSIONS")
    assert all(_within(default[name], tested.specifier) for name, tested in TESTED_RANGES.items()), default


def test_the_installed_releases_are_in_the_tested_range() -> None:
    for name, module in (("torch", torch), ("transformers", transformers)):
        assert _within(module.__version__, TESTED_RANGES[name].specifier), (name, module.__version__)


@pytest.mark.parametrize("module", [compat_torch, compat_transformers], ids=["torch", "transformers"])
def test_every_seam_symbol_resolves(module) -> None:
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []
    assert len(module.__all__) == len(set(module.__all__))


def test_missing_symbol_names_it_the_range_and_the_fix() -> None:
    with pytest.raises(MissingSymbolError) as raised:
        private_symbol("torch", "torch.utils._pytree.tree_map_everything", purpose="mapping everything")
    message = str(raised.value)
    assert "torch.utils._pytree.tree_map_everything (mapping everything)" in message
    assert f"torch {importlib.metadata.version('torch')} does not have" in message
    assert "tested with torch 2.11.0 to 2.14.1" in message
    assert "pip install 'torch>=2.11.0,<2.15'" in message
    assert "automodel/_compat/torch.py" in message
    assert isinstance(raised.value, ImportError) and raised.value.symbol == "torch.utils._pytree.tree_map_everything"


def test_missing_module_is_a_missing_symbol() -> None:
    with pytest.raises(MissingSymbolError, match=r"transformers\.no_such_module\.Thing \(a test\)"):
        private_symbol("transformers", "transformers.no_such_module.Thing", purpose="a test")


def test_moved_symbol_is_found_at_its_older_location() -> None:
    found = private_symbol(
        "transformers",
        "transformers.no_such_module.ALL_PARALLEL_STYLES",
        "transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES",
        purpose="a test",
    )
    assert found is compat_transformers.ALL_PARALLEL_STYLES


def test_plan_lookup_matches_transformers() -> None:
    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    assert compat_transformers.replace_layer_number_by_wildcard("model.layers.12.mlp") == "model.layers.*.mlp"
    assert compat_transformers.get_parameter_plan("model.layers.3.self_attn.q_proj.weight", plan) == "colwise"
    assert compat_transformers.get_parameter_plan("model.layers.3.mlp.up_proj.weight", plan) is None


def test_fsdp_param_groups_reads_each_units_group() -> None:
    """The shim over FSDP2's parameter groups (one optional ``_fsdp_param_group`` to torch 2.11, the list
    ``_fsdp_param_groups`` from 2.12): a unit with parameters has its one group, a unit without has none, and
    ``fsdp_sizes`` reads the groups' padded shards and all-gathers (fp32 on 2 simulated ranks)."""
    dist.init_process_group("fake", rank=0, world_size=2, store=compat_torch.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        for unit in (model[0], model[1], model):
            fully_shard(unit, mesh=mesh)
        (first,) = compat_torch.fsdp_param_groups(model[0])
        (root,) = compat_torch.fsdp_param_groups(model)
        assert compat_torch.fsdp_param_groups(model[1]) == []
        assert [p.sharded_param for p in first.fsdp_params] == [model[0].weight, model[0].bias]
        assert [p.sharded_param for p in root.fsdp_params] == [model[2].weight, model[2].bias]
        assert not first.is_unsharded and not root.is_unsharded
        padded, largest_gather = compat_torch.fsdp_sizes(model)
    finally:
        dist.destroy_process_group()
    shard_elements = {model[0].weight: 3 * 4, model[0].bias: 3, model[2].weight: 1 * 6, model[2].bias: 1}
    assert padded == {id(param): elements * 4 for param, elements in shard_elements.items()}
    assert largest_gather == (3 * 4 + 3) * 2 * 4


def test_dtensor_like_equals_from_local() -> None:
    """``dtensor_like`` (DTensor's constructor with a given spec, what the loader wraps its local shards with) gives
    what ``DTensor.from_local`` gives: the same mesh, placements, global shape and stride, the local tensor's storage,
    no autograd history; on a 2 x 2 mesh with a ``Shard`` and FSDP2's ``_StridedShard`` over a TP-sharded dim."""
    dist.init_process_group("fake", rank=3, world_size=4, store=compat_torch.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for placements, local_shape in (
            ([Shard(0), Shard(1)], (4, 3)),
            ([compat_torch.StridedShard(0, split_factor=2), Shard(0)], (2, 6)),
        ):
            like = DTensor.from_local(
                torch.empty(local_shape, device="meta"), mesh, placements, run_check=False, shape=(8, 6), stride=(6, 1)
            )
            local = torch.zeros(local_shape)
            made = compat_torch.dtensor_like(local, like)
            expected = DTensor.from_local(
                local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
            assert (made.device_mesh, made.placements) == (expected.device_mesh, expected.placements)
            assert (made.shape, made.stride(), made.dtype) == (expected.shape, expected.stride(), expected.dtype)
            assert made.to_local().data_ptr() == local.data_ptr() == expected.to_local().data_ptr()
            assert not made.requires_grad and made.grad_fn is None
    finally:
        dist.destroy_process_group()


def test_shared_mesh_concatenations_builds_each_pair_once() -> None:
    """Inside the block, ``DeviceMesh._concatenate`` answers the same meshes with one mesh, equal to what torch builds
    each time outside it (layout, names, process groups); an overlap is still refused; the block restores torch's
    own on the way out, also when it ends in an error, and a nested block restores the outer one's."""
    dist.init_process_group("fake", rank=3, world_size=4, store=compat_torch.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        torch_own = DeviceMesh.__dict__["_concatenate"]
        apart = DeviceMesh._concatenate([dp, tp])
        assert DeviceMesh._concatenate([dp, tp]) is not apart
        with pytest.raises(KeyError), compat_torch.shared_mesh_concatenations():
            shared = DeviceMesh._concatenate([dp, tp])
            assert DeviceMesh._concatenate([dp, tp]) is shared
            assert DeviceMesh._concatenate([tp, dp]) is not shared
            assert shared == apart and shared.mesh_dim_names == ("dp", "tp")
            assert shared._dim_group_names == apart._dim_group_names
            assert list(shared.get_coordinate()) == list(apart.get_coordinate()) == [1, 1]
            with pytest.raises(RuntimeError, match="overlapping"):
                DeviceMesh._concatenate([dp, dp])
            with compat_torch.shared_mesh_concatenations():
                assert DeviceMesh._concatenate([dp, tp]) is not shared  # the inner block's own
            assert DeviceMesh._concatenate([dp, tp]) is shared
            raise KeyError("an error inside the block")
        assert DeviceMesh.__dict__["_concatenate"] is torch_own
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_shard_chunks_on_demand_are_torchs_chunks(num_chunks) -> None:
    """Each chunk made on demand is the one FSDP2's ``_chunk_with_empty`` makes (shape, stride, storage offset, the
    same storage; the padding an empty tensor of the first chunk's dtype), for sizes that split evenly, unevenly,
    into fewer chunks than asked, and a zero-size dim, on dims 0 and 1, with negative indices; out of range raises."""
    for size, dim in itertools.product((0, 1, 5, 8, 12, 13), (0, 1)):
        tensor = torch.arange(size * 3, dtype=torch.float16).reshape((size, 3) if dim == 0 else (3, size))
        expected = compat_torch._chunk_with_empty(tensor, num_chunks, dim=dim)
        made = compat_torch._ChunksOnDemand(tensor, num_chunks, dim)
        assert len(made) == len(expected) == num_chunks
        for index in range(-num_chunks, num_chunks):
            want, got = expected[index], made[index]
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), (size, dim, index)
            if want.numel():
                assert got.storage_offset() == want.storage_offset()
                assert got.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        with pytest.raises(IndexError):
            made[num_chunks]
    torch_own = compat_torch._fsdp_param_module._chunk_with_empty
    with compat_torch.shard_chunks_on_demand():
        assert compat_torch._fsdp_param_module._chunk_with_empty is compat_torch._ChunksOnDemand
    assert compat_torch._fsdp_param_module._chunk_with_empty is torch_own


_TINY_LLAMA = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=64,
)  # fmt: skip
# Odd sizes, so that some of 8 ranks get a short chunk and some an empty one.
_SHIM_CASES = {
    "llama_fsdp2": ("LlamaConfig", dict(_TINY_LLAMA, vocab_size=67, hidden_size=24), {}),
    "llama_fsdp2_tp2": ("LlamaConfig", dict(_TINY_LLAMA, vocab_size=67, hidden_size=24), {"tp_size": 2}),
    "llama_hsdp2_tp2": ("LlamaConfig", dict(_TINY_LLAMA, vocab_size=67), {"dp_replicate_size": 2, "tp_size": 2}),
    "qwen3_moe_ep2": (  # 2 experts per EP rank over ep_shard=4: FSDP2 shards their rows (dim 1)
        "Qwen3MoeConfig",
        dict(_TINY_LLAMA, vocab_size=67, head_dim=4, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2),
        {"ep_size": 2},
    ),
    "qwen3_moe_ep2_tp2": (
        "Qwen3MoeConfig",
        dict(_TINY_LLAMA, vocab_size=67, head_dim=4, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2),
        {"ep_size": 2, "tp_size": 2},
    ),
}


@pytest.mark.parametrize("rank", [0, 6, 7])
@pytest.mark.parametrize("case", sorted(_SHIM_CASES))
def test_fully_shard_shims_leave_fsdp2_state_as_torch_makes_it(monkeypatch, rank, case) -> None:
    """``parallelize`` with the two ``fully_shard`` shims gives every parameter the FSDP2 state torch gives it without
    them: local shard shape and stride, padding, sharded and post-forward sizes, and the sharded spec (placements,
    mesh, global shape), on ranks 0, 6 and 7 of 8 simulated, under FSDP2, FSDP2 x TP, HSDP x TP, EP and EP x TP."""
    import contextlib

    import automodel.distributed.apply as apply_module

    config_class, sizes, layout = _SHIM_CASES[case]

    def states(shims: bool) -> list[tuple]:
        if not shims:
            monkeypatch.setattr(apply_module, "shared_mesh_concatenations", contextlib.nullcontext)
            monkeypatch.setattr(apply_module, "shard_chunks_on_demand", contextlib.nullcontext)
        model = _sharded_on_meta(getattr(transformers, config_class)(**sizes), layout)
        monkeypatch.undo()
        return [
            (
                unit_name,
                param._module_info.param_name,
                param.sharded_param.to_local().shape,
                param.sharded_param.to_local().stride(),
                param.padded_sharded_param_size,
                param.sharded_size,
                getattr(param, "sharded_post_forward_size", None),
                param._sharding_spec.placements,
                param._sharding_spec.mesh,
                param._sharding_spec.shape,
            )
            for unit_name, unit in model.named_modules()
            if isinstance(unit, FSDPModule)
            for group in compat_torch.fsdp_param_groups(unit)
            for param in group.fsdp_params
        ]

    dist.init_process_group("fake", rank=rank, world_size=8, store=compat_torch.FakeStore())
    try:
        with_shims, without = states(True), states(False)
    finally:
        dist.destroy_process_group()
    assert len(with_shims) == len(without) > 10
    assert with_shims == without


def _sharded_on_meta(config: transformers.PretrainedConfig, layout: dict) -> nn.Module:
    """The model of ``config`` built on meta and parallelized under FSDP2 with ``layout`` on the initialized (fake)
    process group."""
    from automodel.distributed import MeshContext
    from automodel.distributed.parallelizer import parallelizer_for

    context = MeshContext.build("fsdp2", **layout)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return parallelizer_for(model).parallelize(model, context)


def test_fsdp2_tp_parameters_share_one_mesh_after_parallelize() -> None:
    """``parallelize`` under FSDP2 x TP=2 (rank 3 of 4 simulated, a tiny Llama on meta): every TP parameter's FSDP2
    shard lives on the one (dp_shard_cp, tp) mesh, not on a mesh of its own, and torch's ``_concatenate`` is back."""
    torch_own = DeviceMesh.__dict__["_concatenate"]
    dist.init_process_group("fake", rank=3, world_size=4, store=compat_torch.FakeStore())
    try:
        model = _sharded_on_meta(transformers.LlamaConfig(**_TINY_LLAMA), {"tp_size": 2})
        meshes = {
            id(param._spmd_mesh): param._spmd_mesh
            for unit in model.modules()
            if isinstance(unit, FSDPModule)
            for group in compat_torch.fsdp_param_groups(unit)
            for param in group.fsdp_params
            if hasattr(param, "_spmd_mesh")
        }
        (mesh,) = meshes.values()
        assert mesh.mesh_dim_names == ("dp_shard_cp", "tp") and mesh.size() == 4
        assert DeviceMesh.__dict__["_concatenate"] is torch_own
    finally:
        dist.destroy_process_group()
