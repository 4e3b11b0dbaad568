"""An elastic expert group's gang with a rendezvous store of its own (``Gang.store``) under the supervisor
(``fleet/supervisor.py``): the store starts before the members; the first member's loss restarts it alone (the others
and the store keep their processes: it joins them, as any lost rank's restart does); the store's loss restarts the
whole gang with a fresh store (the old one's records name a group that is gone). The members and the store are real
processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_serve.fleet.supervisor import Child, Gang

from ..helpers import wait_until
from .test_elastic_gang_sizes import supervised

pytestmark = pytest.mark.timeout(60)

UP = "import time; print('up', flush=True); time.sleep(60)"


def child(name: str, logs: Path) -> Child:
    """A process that says it is up and sleeps, logging to ``logs``."""
    return Child(name, [sys.executable, "-c", UP], logs / f"{name}.log", dict(os.environ))


def test_rank_zero_restarts_alone_and_the_stores_loss_restarts_the_gang(tmp_path):
    members, store = [child(f"rank-{rank}", tmp_path) for rank in range(3)], child("rendezvous-store", tmp_path)
    renewed = []
    gang = Gang("group 0", members, lambda: renewed.append(1), elastic=True, store=store)
    everyone = [store, *members]
    with supervised(gang):
        wait_until(lambda: all(c.log.read_text() == "up\n" for c in everyone), 30, "the store and three members up")
        first, kept = members[0].proc, [c.proc for c in [store, *members[1:]]]
        first.kill()
        wait_until(lambda: members[0].log.read_text() == "up\nup\n", 30, "rank 0 started again")
        assert members[0].proc is not first and members[0].causes == ["killed by SIGKILL"]
        assert [c.proc for c in [store, *members[1:]]] == kept and all(p.poll() is None for p in kept)
        assert renewed == [1]  # the same rendezvous: it joins the others

        old = [c.proc for c in everyone]
        store.proc.kill()
        wait_until(lambda: all(c.log.read_text().count("up") == 2 + (c is members[0]) for c in everyone), 30,
                   "the gang and a fresh store started again")
        assert renewed == [1, 1] and all(c.proc is not p and c.proc.poll() is None for c, p in zip(everyone, old))
        assert all(p.poll() is not None for p in old)
        assert members[1].causes == ["its gang lost rendezvous-store: killed by SIGKILL"], members[1].causes
