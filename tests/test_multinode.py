"""Two nodes, as a cluster runs them: two ``automodel`` launches (one process each) meeting at a c10d rendezvous on
localhost train exactly as one node with two processes."""

from __future__ import annotations

import socket

import pytest

from tests.recipe_runs import STEPS, Command, losses, make_project

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # whole `automodel` launches: ~30 s each


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_launches_with_a_c10d_rendezvous_train_as_one_node(tmp_path):
    project = make_project(tmp_path / "project")
    one_node = Command(project, tmp_path / "one_node")
    status, stdout = one_node.finish()
    assert status == 0, stdout
    endpoint = f"127.0.0.1:{_free_port()}"
    launch = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint)
    nodes = [Command(project, tmp_path / "two_nodes", launch=(*launch, "--rdzv-id", "test-job")) for _ in range(2)]
    for node in nodes:
        status, _ = node.finish()
        assert status == 0, "".join(node.lines[-30:])
    final = f"step_{STEPS:08d}"
    assert losses(tmp_path / "two_nodes" / final) == losses(tmp_path / "one_node" / final)
