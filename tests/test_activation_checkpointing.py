"""Activation checkpointing saves MoE routing decisions: the backward replay routes tokens exactly as the forward did,
even when recomputing the router would pick other experts (as a recomputed top-k can on GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from automodel.distributed import checkpoint_module
from tests.tiny_models import build_model, tiny_config, token_batch


def _routes_seen(mlp: torch.nn.Module) -> list[torch.Tensor]:
    """Record the expert ids the experts module receives, in forward and in the backward replay."""
    seen: list[torch.Tensor] = []
    mlp.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    return seen


def _perturb_router_on_replay(mlp: torch.nn.Module) -> None:
    """From its second call on, the router sees negated inputs: a recomputed top-k then picks other experts."""
    calls = []

    def hook(module, args):
        calls.append(1)
        # The same op both times (selective checkpointing checks that the replay runs the forward's ops).
        return (args[0] * (1.0 if len(calls) == 1 else -1.0),)

    mlp.gate.register_forward_pre_hook(hook)


def _run(mlp_forward_wrapper) -> tuple[list[torch.Tensor], torch.nn.Module]:
    model = build_model(tiny_config("mixtral", num_hidden_layers=1))
    mlp = model.model.layers[0].mlp
    seen = _routes_seen(mlp)
    _perturb_router_on_replay(mlp)
    mlp_forward_wrapper(mlp)
    batch = token_batch()
    model(input_ids=batch, labels=batch).loss.backward()
    return seen, model


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_replay_routes_tokens_as_the_forward_did(selective):
    seen, model = _run(functools.partial(checkpoint_module, selective=selective))
    forward, replay = seen
    assert torch.equal(forward, replay)
    assert all(p.grad is not None for p in model.parameters())


def test_plain_recomputation_would_route_differently():
    """The control: torch's checkpoint alone recomputes top-k, and the perturbed router then routes elsewhere."""

    def plain_checkpoint(mlp):
        inner = mlp.forward
        mlp.forward = lambda *args, **kwargs: checkpoint(inner, *args, use_reentrant=False, **kwargs)

    forward, replay = _run(plain_checkpoint)[0]
    assert not torch.equal(forward, replay)
