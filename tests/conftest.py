"""Shared fixtures: one persistent CPU gloo rank pool per world size for the whole session."""

from __future__ import annotations

import pytest

from tests.harness import RankPool


@pytest.fixture(scope="session")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()
