"""The rank pool itself: a failure that one rank sees fails the case with that rank's message, without hanging."""

from __future__ import annotations

import time

import pytest

from tests.cases.hooks import fail_on_rank, rank_id
from tests.harness import RankFailure

pytestmark = pytest.mark.distributed


def test_one_failing_rank_fails_the_case_on_every_rank_without_hanging(ranks2):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        ranks2.run(fail_on_rank, 1)
    assert "shard file unreadable on rank 1" in str(info.value)
    assert "rank 0: no answer" in str(info.value)
    assert time.monotonic() - start < 60
    # The pool restarts cleanly for the next case.
    assert ranks2.run(rank_id) == [0, 1]
