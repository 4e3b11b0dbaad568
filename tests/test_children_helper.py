"""tests/helpers.py's :class:`Children`: engines and rendezvous stores forked from the product's launcher (one torch
import for all of them), exec'd where it refuses or where the test asks, and every kind held alike (signals, exit
codes, logs, teardown)."""

from __future__ import annotations

import os
import sys
import signal
from pathlib import Path

from tests.helpers import Children, alive, shared_launcher, wait_until

STORE = ["rendezvous-store", "--host", "127.0.0.1", "--port", "0"]


def stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def serving(children: Children, proc) -> None:
    wait_until(lambda: "rendezvous store serving" in children.log_of(proc) or proc.poll() is not None, 120,
               "the store to serve")
    assert proc.poll() is None, children.log_of(proc)


def test_a_store_is_forked_from_the_launcher_and_held_as_an_execd_one(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        proc = children.spawn(STORE, "store")
        serving(children, proc)
        parent = int(stat(proc.pid)[1])
        assert parent != os.getpid() and b"megatron_serve.commands.launcher" in Path(
            f"/proc/{parent}/cmdline").read_bytes()
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"%s -m megatron_serve.cli rendezvous-store"
                                                                          % os.fsencode(sys.executable))
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: stat(proc.pid)[0] == "T", 10, "the store to stop")
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: stat(proc.pid)[0] != "T", 10, "the store to continue")
        assert children.refusals == []
    finally:
        children.kill_all()
    assert proc.returncode == -signal.SIGKILL
    assert not alive(parent), "kill_all leaves the launcher running"


def test_fork_false_execs_every_child(tmp_path: Path) -> None:
    children = Children(tmp_path, fork=False)
    try:
        proc = children.spawn(STORE, "store")
        serving(children, proc)
        assert int(stat(proc.pid)[1]) == os.getpid()
    finally:
        children.kill_all()
    assert proc.returncode == -signal.SIGKILL


def test_a_refused_child_is_execd_and_the_refusal_says_why(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        forked = children.spawn(STORE, "store")
        refused = children.spawn(STORE, "store", env={"MEGATRON_TEST_OTHER": "1"})  # read at import: no fork
        serving(children, forked)
        serving(children, refused)
        assert int(stat(forked.pid)[1]) != os.getpid()
        assert int(stat(refused.pid)[1]) == os.getpid()
        assert len(children.refusals) == 1 and "MEGATRON_TEST_OTHER" in children.refusals[0], children.refusals
    finally:
        children.kill_all()
    assert forked.returncode == refused.returncode == -signal.SIGKILL


def test_children_of_a_shared_launcher_fork_from_it_and_leave_it_running(tmp_path: Path) -> None:
    """Two tests' fleets (each its own secret) forked by one launcher: the first's ``kill_all`` ends its children
    and leaves the launcher to the second; the block's end ends it."""
    with shared_launcher(tmp_path) as launcher:
        first = Children(tmp_path / "first", launcher=launcher)
        second = Children(tmp_path / "second", launcher=launcher)
        for children in (first, second):
            children.log_dir.mkdir()
        assert first.secret != second.secret
        try:
            one = first.spawn(STORE, "store")
            serving(first, one)
            parent = int(stat(one.pid)[1])
        finally:
            first.kill_all()
        assert one.returncode == -signal.SIGKILL and alive(parent), "kill_all ended the shared launcher"
        try:
            two = second.spawn(STORE, "store")
            serving(second, two)
            assert int(stat(two.pid)[1]) == parent and first.refusals == second.refusals == []
        finally:
            second.kill_all()
    assert not alive(parent), "the shared launcher outlived its block"
