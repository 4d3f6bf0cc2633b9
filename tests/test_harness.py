"""The rank pool itself: a failure that one rank sees fails the case with that rank's message, without hanging; a
hung rank is named as hung with its Python stack printed, a dead one with its exit code; the pool starts afresh for
the next case."""

from __future__ import annotations

import time

import pytest

from tests.cases.harness import crash_on_rank_one, exit_on_rank_one, stall_on_rank_one
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


def test_a_hung_rank_is_reported_with_its_stack(ranks2):
    with pytest.raises(RankFailure) as failure:
        ranks2.run(stall_on_rank_one, timeout=5.0)
    report = str(failure.value)
    assert "--- rank 0: ok" in report, report
    # faulthandler's dump of rank 1: every thread, the main one inside the case.
    assert "--- rank 1: no answer (hung)\nits Python stacks (faulthandler):" in report, report
    assert "in stall_on_rank_one" in report, report
    # The pool was torn down; the next case gets a fresh rank group.
    assert ranks2.run(rank_id) == [0, 1]


def test_a_dead_rank_is_reported_with_its_exit_code(ranks2):
    with pytest.raises(RankFailure) as failure:
        ranks2.run(exit_on_rank_one)
    assert "--- rank 1: no answer (died with exit code 3)" in str(failure.value), failure.value
    assert ranks2.run(rank_id) == [0, 1]


def test_a_rank_killed_by_a_crash_is_reported_with_its_stack(ranks2):
    """A segfault in native code (as in a gloo transport thread) names the signal and where the rank's Python was."""
    with pytest.raises(RankFailure) as failure:
        ranks2.run(crash_on_rank_one)
    report = str(failure.value)
    assert "--- rank 1: no answer (died with exit code -11)\nits Python stacks (faulthandler):" in report, report
    assert "Segmentation fault" in report and "in crash_on_rank_one" in report, report
    assert ranks2.run(rank_id) == [0, 1]


def test_a_failure_cut_short_keeps_every_rank_status():
    """A sweep keeps a few thousand characters of a failure: the rank that died must survive the cut, though the
    report ends with a peer's long traceback."""
    report = "\n".join(
        [
            "case failed on the rank group of 2:",
            "--- rank 0: no answer (died with exit code -11)",
            "--- rank 1: error",
            "Traceback ...\n" * 400 + "RuntimeError: Connection closed by peer",
        ]
    )
    brief = RankFailure(report).brief(500)
    assert brief.startswith(
        "case failed on the rank group of 2:\n--- rank 0: no answer (died with exit code -11)\n--- rank 1: error\n[...]"
    ), brief
    assert brief.endswith("RuntimeError: Connection closed by peer") and len(brief) <= 520, brief
    assert "died with exit code" not in report[-500:]  # what a bare tail would have kept
    assert RankFailure("short").brief() == "short"
    # Status lines longer than the limit are kept whole, without a tail.
    assert RankFailure(report).brief(10) == "\n".join(report.splitlines()[:3])
