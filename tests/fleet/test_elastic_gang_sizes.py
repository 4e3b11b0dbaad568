"""An elastic expert group's gang under the supervisor (``fleet/supervisor.py``): a member that exits 0 (``scale-ep``
took it out) stays out, and starts again, on the gang's rendezvous, once the group is wanted at a size above its rank
(``Supervisor.want_ranks``), but only for a size read after it exited (an older reading predates the ask that took
it out). The members are real processes that exit 0 on SIGTERM, as a rank that leaves its group does."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from megatron_serve.processes.lifeline import Lifeline
from megatron_serve.fleet.supervisor import Child, Gang, Supervisor

from ..helpers import wait_until

pytestmark = pytest.mark.timeout(60)

MEMBER = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
          "print('up', flush=True); time.sleep(60)")


@contextlib.contextmanager
def supervised(gang: Gang) -> Iterator[Supervisor]:
    """``gang`` started under a supervisor that restarts the dead (back-off from 0.05 s); every process ended after."""
    lifeline = Lifeline()
    supervisor = Supervisor(lifeline, initial=0.05)
    try:
        supervisor.start_gang(gang)
        supervisor.restart_dead(True)
        yield supervisor
    finally:
        supervisor.close()
        for child in [*gang.members, *([gang.store] if gang.store is not None else [])]:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
        lifeline.close()


def test_a_member_taken_out_stays_out_until_its_group_is_wanted_above_its_rank(tmp_path):
    members = [Child(f"engine {rank} (group 0, data-parallel rank {rank})", [sys.executable, "-c", MEMBER],
                     tmp_path / f"engine-{rank}.log", dict(os.environ)) for rank in range(3)]
    renewed = []
    gang = Gang("group 0", members, lambda: renewed.append(1), elastic=True)
    with supervised(gang) as supervisor:
        wait_until(lambda: all(m.log.read_text() == "up\n" for m in members), 30, "three members up")
        left, kept = members[2].proc, [m.proc for m in members[:2]]
        before = time.monotonic()
        left.send_signal(signal.SIGTERM)
        wait_until(lambda: members[2].retired, 30, "the last rank retired")
        supervisor.want_ranks(gang, 2, time.monotonic())  # the size that took it out: it stays out
        supervisor.want_ranks(gang, 3, before)  # read before it exited: older than the ask that took it out
        assert members[2].proc is left and members[2].retired
        supervisor.want_ranks(gang, 3, time.monotonic())
        assert members[2].proc is not left and members[2].proc.poll() is None and not members[2].retired
        wait_until(lambda: members[2].log.read_text() == "up\nup\n", 30, "the rank started again")
        assert members[2].causes == ["its group is wanted at 3 ranks"] and renewed == [1]  # same rendezvous
        assert [m.proc for m in members[:2]] == kept and all(proc.poll() is None for proc in kept)
