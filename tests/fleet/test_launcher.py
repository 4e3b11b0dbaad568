"""The fleet's launcher (commands/launcher.py) with real processes: what it forks is what an exec would have
started, it refuses what a fork cannot start faithfully (the supervisor then execs it), and its death takes its
children with it.

The child is a real ``megatron-serve rendezvous-store`` (it imports torch, as an engine does, and serves until
SIGTERM), forked from a real launcher, beside the same command exec'd as the fleet did before.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_serve.fleet.launcher_client import ForkedProcess, Launcher, Refused
from megatron_serve.processes.lifeline import Lifeline
from megatron_serve.fleet.supervisor import Child, Supervisor, end_process_group

from tests.helpers import wait_until
from tests.run_stack import command_line

pytestmark = pytest.mark.timeout(300)

STORE = [sys.executable, "-m", "megatron_serve.cli", "rendezvous-store", "--host", "127.0.0.1", "--port", "0"]
SERVING = "rendezvous store serving at"


def stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, session..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def signal_masks(pid: int) -> dict[str, str]:
    """Its blocked, ignored and caught signals, as /proc says them."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)
            if key in ("SigBlk", "SigIgn", "SigCgt")}


def serving(log: Path) -> bool:
    return log.exists() and SERVING in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[tuple[Launcher, dict[str, str]]]:
    """One launcher for the module's tests (each start imports torch again), and the environment it runs with:
    this process's when the module started, which each child is given (``os.environ`` itself differs from test to
    test in ``PYTEST_CURRENT_TEST``, and the launcher refuses a child whose environment differs). A test that kills
    it leaves the next spawn to start a fresh one, as the fleet's does."""
    lifeline = Lifeline()
    launcher = Launcher(lifeline, tmp_path_factory.mktemp("launcher") / "launcher.log")
    environment = dict(os.environ)
    launcher.start(environment)
    yield launcher, environment
    launcher.close()
    lifeline.close()


@pytest.fixture
def launcher(shared) -> Launcher:
    return shared[0]


@pytest.fixture
def env(shared) -> dict[str, str]:
    return dict(shared[1])


def test_a_forked_child_is_what_an_exec_would_have_started(launcher, env, tmp_path):
    forked = launcher.spawn(STORE, env, tmp_path / "forked.log")
    exec_log = tmp_path / "exec.log"
    with open(exec_log, "wb") as out:
        execd = subprocess.Popen(STORE, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        assert isinstance(forked, ForkedProcess)
        wait_until(lambda: serving(tmp_path / "forked.log") and serving(exec_log), 120, "both stores to serve")
        fields = stat(forked.pid)
        assert int(fields[1]) == launcher.proc.pid  # the launcher's child, not this process's
        assert int(fields[2]) == int(fields[3]) == forked.pid  # a session (and process group) of its own
        assert command_line(forked.pid) == STORE == command_line(execd.pid)
        assert os.readlink(f"/proc/{forked.pid}/fd/0") == os.devnull
        assert os.readlink(f"/proc/{forked.pid}/fd/1") == os.readlink(f"/proc/{forked.pid}/fd/2") == \
            str(tmp_path / "forked.log")
        # the lifeline's pipe at its number, and no descriptor of the launcher's (its socket, its children's pidfds)
        links = {int(fd): os.readlink(f"/proc/{forked.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{forked.pid}/fd")}
        assert launcher.lifeline.pass_fds()[0] in links
        assert not any(link.startswith("anon_inode:[pidfd]") for link in links.values()), links
        # the same signal dispositions and mask as the exec'd one (the store blocks SIGTERM and SIGINT itself)
        assert signal_masks(forked.pid) == signal_masks(execd.pid)
        with pytest.raises(subprocess.TimeoutExpired):
            forked.wait(0.1)
        forked.terminate()
        execd.terminate()
        assert forked.wait(60) == 0 == execd.wait(60)  # it exits 0 on SIGTERM, as the exec'd one does
        assert forked.poll() == 0 and not Path(f"/proc/{forked.pid}").exists()  # reaped by the launcher
    finally:
        execd.kill()
        forked.kill()


def test_a_descriptor_passed_arrives_at_the_number_asked(launcher, env, tmp_path):
    """As the lifeline's and an API server's socket are passed: the child holds the very pipe, at that number."""
    read, write = os.pipe()
    # a number of its own: dup2 onto a fixed one closed whatever the worker held there (the pipe's own end, once)
    target = fcntl.fcntl(write, fcntl.F_DUPFD, 40)
    os.close(write)
    try:
        child = launcher.spawn(STORE, env, tmp_path / "store.log", pass_fds=(target,))
        wait_until(lambda: serving(tmp_path / "store.log"), 120, "the store to serve")
        assert os.readlink(f"/proc/{child.pid}/fd/{target}") == os.readlink(f"/proc/self/fd/{target}")
        child.kill()
        assert child.wait(60) == -signal.SIGKILL
    finally:
        os.close(target)
        os.close(read)


def test_a_child_whose_environment_differs_in_a_variable_read_at_import_is_refused(launcher, env, tmp_path):
    launcher.start(env)  # the fleet's environment, which its imports run with
    with pytest.raises(Refused, match="OMP_NUM_THREADS"):
        launcher.spawn(STORE, {**env, "OMP_NUM_THREADS": "3"}, tmp_path / "refused.log")
    with pytest.raises(Refused, match="PYTHONHASHSEED"):
        launcher.spawn(STORE, {**env, "PYTHONHASHSEED": "7"}, tmp_path / "refused.log")
    # the control: variables read after the imports (a gang's rendezvous, the fleet's secret) may differ
    child = launcher.spawn(STORE, {**env, "MASTER_PORT": "29999", "MEGATRON_SERVE_TOKEN": "x" * 40},
                           tmp_path / "store.log")
    wait_until(lambda: serving(tmp_path / "store.log"), 120, "the store to serve")
    child.kill()
    child.wait(60)


def test_the_supervisor_execs_a_child_the_launcher_refuses(tmp_path, caplog):
    lifeline = Lifeline()
    supervisor = Supervisor(lifeline, launcher=Launcher(lifeline, tmp_path / "launcher.log"))
    forked = Child("store 0", STORE, tmp_path / "forked.log", dict(os.environ), fork=True)
    execd = Child("store 1", STORE, tmp_path / "execd.log", {**os.environ, "OMP_NUM_THREADS": "3"}, fork=True)
    try:
        supervisor.start_launcher(dict(os.environ))
        supervisor.start_child(forked)
        supervisor.start_child(execd)
        assert isinstance(forked.proc, ForkedProcess)
        assert isinstance(execd.proc, subprocess.Popen)  # this process's own child: exec'd as before
        assert int(stat(execd.proc.pid)[1]) == os.getpid()
        assert "store 1: the launcher cannot fork it (its environment differs from the launcher's in OMP_NUM_THREADS" \
            in caplog.text
        wait_until(lambda: serving(tmp_path / "forked.log") and serving(tmp_path / "execd.log"), 120,
                   "both stores to serve")
    finally:
        for child in (forked, execd):
            end_process_group(child.proc)
        supervisor.close()
        lifeline.close()


def test_the_launchers_death_ends_its_children_and_the_next_start_brings_a_fresh_one(launcher, env, tmp_path):
    first = launcher.spawn(STORE, env, tmp_path / "first.log")
    wait_until(lambda: serving(tmp_path / "first.log"), 120, "the store to serve")
    dead = launcher.proc.pid
    os.kill(dead, signal.SIGKILL)
    assert first.wait(60) == -signal.SIGKILL  # its parent-death signal
    assert not Path(f"/proc/{first.pid}").exists() or stat(first.pid)[0] == "Z"
    second = launcher.spawn(STORE, env, tmp_path / "second.log")
    assert launcher.proc.pid != dead and int(stat(second.pid)[1]) == launcher.proc.pid
    wait_until(lambda: serving(tmp_path / "second.log"), 120, "the second store to serve")
    second.kill()
    assert second.wait(60) == -signal.SIGKILL
