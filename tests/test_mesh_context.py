"""``MeshContext``: every impossible layout fails at build time with the numbers; sizes come from live meshes."""

from __future__ import annotations

import pytest
import torch

from automodel.distributed import DDPConfig, FSDP2Config, MegatronFSDPConfig
from automodel.distributed.config import strategy_from_name
from automodel.distributed.layout import _validate_layout
from automodel.distributed.mesh import _normalize_activation_checkpointing
from tests.cases import hooks


def _layout_error(strategy="fsdp2", world=4, dp_replicate=1, tp=1, cp=1, ep=1, sp=False) -> str:
    with pytest.raises((ValueError, RuntimeError)) as info:
        _validate_layout(strategy_from_name(strategy), world, dp_replicate, tp, cp, ep, sp)
    return str(info.value)


def test_sizes_that_do_not_divide_the_world_size():
    message = _layout_error(world=4, tp=3)
    assert "1 * 1 * 3 = 3 does not divide the world size 4" in message


def test_ep_that_does_not_divide_the_replica():
    message = _layout_error(world=4, dp_replicate=2, ep=4)
    assert "ep_size=4 must divide dp_shard * cp_size * tp_size = 2 * 1 * 1 = 2" in message


@pytest.mark.parametrize("extra", [{"dp_replicate": 2}, {"tp": 2}, {"cp": 2}, {"ep": 2}])
def test_ddp_refuses_replicate_tp_cp_and_ep(extra):
    message = _layout_error(strategy="ddp", **extra)
    name = {"dp_replicate": "dp_replicate_size", "tp": "tp_size", "cp": "cp_size", "ep": "ep_size"}[next(iter(extra))]
    assert f"{name}=2" in message and "DDP" in message and "strategy='fsdp2'" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_megatron_fsdp_without_cuda_says_so_plainly():
    message = _layout_error(strategy="megatron_fsdp")
    assert "needs CUDA GPUs" in message and "torch.cuda.is_available() is False" in message


def test_unknown_strategy_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown strategy 'zero3'.*\['ddp', 'fsdp2', 'megatron_fsdp'\]"):
        strategy_from_name("zero3")


def test_sequence_parallel_needs_tp():
    assert "needs tp_size > 1" in _layout_error(sp=True)


def test_sizes_must_be_positive():
    assert "tp_size must be a positive integer, got 0" in _layout_error(tp=0)


def test_activation_checkpointing_modes():
    assert _normalize_activation_checkpointing(True) == "full"
    assert _normalize_activation_checkpointing("selective") == "selective"
    assert _normalize_activation_checkpointing(False) is False
    with pytest.raises(ValueError, match="'sometimes' is not a mode"):
        _normalize_activation_checkpointing("sometimes")


def test_strategy_configs():
    assert FSDP2Config().mp_policy() is None
    policy = FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert FSDP2Config(cpu_offload=True).offload_policy() is not None
    assert isinstance(strategy_from_name("ddp"), DDPConfig)
    assert MegatronFSDPConfig(zero_dp_strategy=1).megatron_kwargs()["zero_dp_strategy"] == 1


@pytest.mark.distributed
def test_build_fails_on_every_rank_with_the_same_message(ranks4):
    messages = ranks4.run(hooks.build_error, {"strategy": "fsdp2", "tp_size": 3})
    assert len(set(messages)) == 1 and "does not divide the world size 4" in messages[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ({"strategy": "fsdp2"}, {"dp_shard": 4, "dp": 4, "dp_shard_cp": 4, "dp_cp": 4, "tp": 1}),
        ({"strategy": "fsdp2", "dp_replicate_size": 2, "tp_size": 1}, {"dp_replicate": 2, "dp_shard": 2, "dp": 4}),
        ({"strategy": "fsdp2", "tp_size": 2}, {"dp_shard": 2, "tp": 2, "dp": 2, "dp_shard_cp": 2}),
        ({"strategy": "fsdp2", "cp_size": 2}, {"dp_shard": 2, "cp": 2, "dp": 2, "dp_shard_cp": 4, "dp_cp": 4}),
        ({"strategy": "fsdp2", "ep_size": 2}, {"dp_shard": 4, "ep": 2, "ep_shard": 2}),
        ({"strategy": "ddp"}, {"dp_shard": 4, "dp": 4}),
    ],
)
def test_sizes_are_read_from_the_live_meshes(ranks4, layout, expected):
    facts = ranks4.run(hooks.mesh_facts, layout)[0]
    assert facts["device_type"] == "cpu" and facts["world"] == 4
    assert {key: facts[key] for key in expected} == expected


@pytest.mark.distributed
def test_from_meshes_rejects_unknown_axis_names(ranks2):
    message = ranks2.run(hooks.from_meshes_error, ("dp_shard", "model"))[0]
    assert "not canonical" in message and "model" in message


@pytest.mark.distributed
def test_from_meshes_completes_a_partial_canonical_mesh(ranks2):
    assert ranks2.run(hooks.from_meshes_error, ("dp_shard", "tp"))[0] == "ok dp_shard=2 tp=1"
