"""The tenants' budgets (server/tenant_budgets.py): the store that the processes of ``--api-server-count`` share holds
one budget for all of them, where each process's own store (the control: every server process before) held a whole
budget each. Two stores on one file stand for two processes here; tests/commands/test_api_server_count.py drives
two real server processes."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest

from megatron_serve.server.tenant_budgets import BUDGETS_FILE, LocalBudgets, SharedBudgets
from megatron_serve.server.tenants import Tenant, TenantLimits

TEAM = Tenant("team", "standard", 1.0, TenantLimits(tokens_per_minute=600, requests_per_minute=3, max_concurrent=2))


def admit(store, now: float, tokens: int = 100) -> bool:
    """What an admission does with a tenant's state: a request goes in if every limit has room."""
    with store.hold(TEAM, now) as state:
        if (state.running >= 2 or state.requests.wait(1, now) > 0 or state.tokens.wait(tokens, now) > 0):
            return False
        state.requests.take(1)
        state.tokens.take(tokens)
        state.running += 1
        return True


def test_two_processes_stores_on_one_file_hold_one_budget(tmp_path):
    first, second = SharedBudgets(tmp_path), SharedBudgets(tmp_path)
    assert [admit(first, 0.0), admit(second, 0.0), admit(second, 0.0)] == [True, True, False]  # max_concurrent 2
    with first.hold(TEAM, 0.0) as state:
        state.running -= 1
    assert admit(second, 0.0) and not admit(first, 0.0)  # requests_per_minute 3 across both
    with second.hold(TEAM, 20.0) as state:  # a third of a minute: one request and 200 tokens back
        assert state.running == 2 and state.requests.wait(1, 20.0) == 0
        assert state.tokens.wait(500, 20.0) == 0 < state.tokens.wait(501, 20.0)
        state.running -= 2
    with pytest.raises(RuntimeError), first.hold(TEAM, 20.0) as state:
        state.running += 5
        raise RuntimeError("a refusal, or anything else: nothing it changed is kept")
    assert admit(first, 20.0) and not admit(second, 20.0)


def test_control_each_process_with_its_own_store_admits_the_whole_budget():
    first, second = LocalBudgets(), LocalBudgets()
    assert [admit(first, 0.0), admit(first, 0.0), admit(second, 0.0), admit(second, 0.0)] == [True] * 4


def test_an_idle_tenant_leaves_nothing_and_a_dead_process_requests_are_dropped(tmp_path):
    store = SharedBudgets(tmp_path)
    assert admit(store, 0.0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with sqlite3.connect(tmp_path / BUDGETS_FILE) as db:
        db.execute("INSERT INTO running VALUES ('team', ?, 2)", (dead.pid,))
    assert not admit(store, 0.0)  # three in progress, one of them here
    assert admit(SharedBudgets(tmp_path), 0.0)  # a process opening the store drops the dead one's
    with store.hold(TEAM, 60.0) as state:
        state.running -= 2
    with sqlite3.connect(tmp_path / BUDGETS_FILE) as db:
        assert db.execute("SELECT COUNT(*) FROM budgets").fetchone() == (0,)  # full again: as never seen
        assert db.execute("SELECT COUNT(*) FROM running").fetchone() == (0,)
