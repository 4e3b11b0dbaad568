"""Where a server keeps its tenants' budgets (tokens and requests per minute, requests in progress): in its own
memory, or, with ``--api-server-count`` N > 1, in one file the N processes share, so that a tenant's limits hold
for the whole server rather than N times over (docs/tenants.md).

The N processes of one server always run on one host (they accept from one listening socket), so a SQLite file in
the directory they already share (``$PROMETHEUS_MULTIPROC_DIR``, :attr:`ServerMetrics.shared_dir`) is seen by every
one of them, and a write transaction (``BEGIN IMMEDIATE``) makes a request's check and reservation one step that
no other process interleaves with. The coordinator sees every request too, but only once it is admitted: a refusal
must be answered before the request is sent, from where the request arrives.

Both stores hand out a :class:`TenantState` as a context: the admission checks and changes it inside the ``with``,
and a shared store writes it back at the end (and leaves nothing behind for a tenant that is idle again).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..processes.pids import process_exists

if TYPE_CHECKING:
    from .tenants import Tenant

#: The shared store's file, in the directory the server's processes share (not ``*.db``: Prometheus reads those).
BUDGETS_FILE = "tenant-budgets.sqlite3"
#: Header-named tenants' budgets a process keeps at most in memory (the idle ones go first).
MAX_TRACKED = 10_000


class RateBucket:
    """``limit`` units a minute: full at first, spent by requests, refilled at ``limit / 60`` a second."""

    __slots__ = ("limit", "level", "stamp")

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self.level = float(limit)
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(float(self.limit), self.level + (now - self.stamp) * self.limit / 60.0)
            self.stamp = now

    def wait(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` fits (0: now)."""
        self._refill(now)
        missing = cost - self.level
        return 0.0 if missing <= 1e-9 else missing * 60.0 / self.limit

    def take(self, cost: float) -> None:
        self.level -= cost

    def give(self, amount: float, now: float) -> None:
        """Return what a request reserved and did not use."""
        self._refill(now)
        self.level = min(float(self.limit), self.level + amount)

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.level >= self.limit


class TenantState:
    """One tenant's budgets and requests in progress; its own context (a store in memory hands out the same one)."""

    __slots__ = ("tokens", "requests", "running")

    def __init__(self, tenant: Tenant, now: float) -> None:
        limits = tenant.limits
        self.tokens = None if limits.tokens_per_minute is None else RateBucket(limits.tokens_per_minute, now)
        self.requests = None if limits.requests_per_minute is None else RateBucket(limits.requests_per_minute, now)
        self.running = 0

    def idle(self, now: float) -> bool:
        return (not self.running and (self.tokens is None or self.tokens.full(now))
                and (self.requests is None or self.requests.full(now)))

    def __enter__(self) -> TenantState:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class LocalBudgets:
    """The budgets of one server process, in its memory."""

    def __init__(self) -> None:
        self.states: dict[str, TenantState] = {}

    def hold(self, tenant: Tenant, now: float) -> TenantState:
        """``tenant``'s state, to check and change inside a ``with`` (``now``: the admission's clock)."""
        state = self.states.get(tenant.name)
        if state is None:
            if len(self.states) >= MAX_TRACKED:
                self.states = {name: s for name, s in self.states.items() if not s.idle(now)}
            state = self.states[tenant.name] = TenantState(tenant, now)
        return state


class SharedBudgets:
    """The budgets of every process of one server, in a SQLite file they share (module docstring). A tenant's row
    holds its buckets' levels; its requests in progress are counted per process, so that those of a process that
    died (its sibling is restarted) are dropped when a process opens the store."""

    def __init__(self, directory: str | Path) -> None:
        self._lock = threading.Lock()  # one transaction at a time on this process's connection
        self.db = sqlite3.connect(Path(directory) / BUDGETS_FILE, timeout=30, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")  # a process that dies mid-transaction leaves the file whole
        self.db.execute("PRAGMA synchronous=OFF")  # the file dies with the server: nothing to keep across a crash
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("CREATE TABLE IF NOT EXISTS budgets (tenant TEXT PRIMARY KEY, tokens REAL, tokens_at REAL,"
                            " requests REAL, requests_at REAL)")
            self.db.execute("CREATE TABLE IF NOT EXISTS running (tenant TEXT, pid INTEGER, count INTEGER, "
                            "PRIMARY KEY (tenant, pid))")
            gone = [pid for (pid,) in self.db.execute("SELECT DISTINCT pid FROM running") if not process_exists(pid)]
            self.db.executemany("DELETE FROM running WHERE pid = ?", [(pid,) for pid in gone])
            self.db.execute("COMMIT")

    def hold(self, tenant: Tenant, now: float) -> _Held:
        """``tenant``'s state, read at the ``with``'s start and written back at its end, no other process between
        (``now``: the admission's clock, ``time.monotonic``: one clock for every process on the host)."""
        return _Held(self, tenant, now)


class _Held:
    """One transaction on a tenant's shared state: read at the start, written back at the end."""

    __slots__ = ("budgets", "tenant", "now", "state", "running")

    def __init__(self, budgets: SharedBudgets, tenant: Tenant, now: float) -> None:
        self.budgets = budgets
        self.tenant = tenant
        self.now = now

    def __enter__(self) -> TenantState:
        budgets = self.budgets
        budgets._lock.acquire()
        db = budgets.db
        try:
            db.execute("BEGIN IMMEDIATE")
            name = self.tenant.name
            self.state = state = TenantState(self.tenant, self.now)
            row = db.execute("SELECT tokens, tokens_at, requests, requests_at FROM budgets WHERE tenant = ?",
                             (name,)).fetchone()
            if row is not None:
                for bucket, level, stamp in ((state.tokens, row[0], row[1]), (state.requests, row[2], row[3])):
                    if bucket is not None and level is not None:
                        bucket.level, bucket.stamp = level, stamp
            (running,) = db.execute("SELECT COALESCE(SUM(count), 0) FROM running WHERE tenant = ?",
                                    (name,)).fetchone()
            self.running = state.running = running
        except BaseException:
            self._end("ROLLBACK")
            raise
        return state

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if kind is not None:  # a refusal (429, 400) changed nothing; anything else must change nothing
            self._end("ROLLBACK")
            return
        try:
            self._write()
        except BaseException:
            self._end("ROLLBACK")
            raise
        self._end("COMMIT")

    def _write(self) -> None:
        db, state, name = self.budgets.db, self.state, self.tenant.name
        delta = state.running - self.running
        if delta:
            db.execute("INSERT INTO running VALUES (?, ?, ?) ON CONFLICT (tenant, pid) DO UPDATE SET count = count + "
                       "excluded.count", (name, os.getpid(), delta))
            db.execute("DELETE FROM running WHERE tenant = ? AND count = 0", (name,))
        if state.idle(self.now):  # as a tenant never seen: nothing to keep
            db.execute("DELETE FROM budgets WHERE tenant = ?", (name,))
            return
        tokens, requests = state.tokens, state.requests
        db.execute("INSERT OR REPLACE INTO budgets VALUES (?, ?, ?, ?, ?)",
                   (name, None if tokens is None else tokens.level, None if tokens is None else tokens.stamp,
                    None if requests is None else requests.level, None if requests is None else requests.stamp))

    def _end(self, statement: str) -> None:
        """COMMIT or ROLLBACK (none when BEGIN itself failed), and the connection is free again."""
        db = self.budgets.db
        try:
            if db.in_transaction:
                db.execute(statement)
        finally:
            self.budgets._lock.release()
