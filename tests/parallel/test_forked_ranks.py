"""The forked ranks of this folder's tests (``forked_ranks.py``): their reports and failures come back to the test's
process, and a rank past its time-out is killed rather than left waiting (as one waits for a peer that failed)."""

from __future__ import annotations

import os
import time

import pytest

from .forked_ranks import forked_reports, report


def rank(index: int, sleep_s: float) -> None:
    os.write(1, b"not a report\n")  # what gloo or torch write to the same stdout is left out
    time.sleep(sleep_s)
    if index == 2:
        raise RuntimeError("rank 2 fails")
    report(index, os.getpid())


def test_each_rank_reports_from_a_process_of_its_own_and_a_failure_is_counted():
    failed, said = forked_reports(rank, [(0, 0), (1, 0), (2, 0)])
    assert failed == 1
    assert sorted(index for index, _ in said) == ["0", "1"]
    assert len({pid for _, pid in said} | {str(os.getpid())}) == 3


def test_a_rank_past_the_time_out_is_killed_and_counted():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 2 forked ranks still ran at their time-out: killed"):
        forked_reports(rank, [(0, 0), (1, 60)], timeout=1)
    assert time.monotonic() - started < 30
