"""``megatron-serve run --engines 2`` whose engines are forked from its launcher (the default), hurt in file order:
an engine killed, the launcher killed, the run killed; and ``--engine-start exec``, the fresh interpreters of before.

Each case checks where the engines come from (/proc: their parent, their session, their command line) and that the
run serves afterwards (a completion over HTTP, and ``/ready`` with two live engines).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import http_post, until, wait_until
from tests.run_stack import RunStack, alive, command_line, start_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, session..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def completes(stack: RunStack) -> None:
    response = http_post(f"{stack.url}/v1/completions", timeout=120,
                         json={"model": stack.model, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def forked_engines(stack: RunStack) -> tuple[int, list[int]]:
    """The run's launcher and its engines, each checked to be a session leader forked by it whose command line
    reads as the engine command."""
    children = stack.children()
    (launcher,) = children["launcher"]
    assert int(stat(launcher)[1]) == stack.proc.pid
    engines = children["engine"]
    assert len(engines) == 2, children
    for pid in engines:
        fields = stat(pid)
        assert int(fields[1]) == launcher and int(fields[2]) == int(fields[3]) == pid, (pid, fields)
        argv = command_line(pid)
        assert argv[1:4] == ["-m", "megatron_serve.cli", "engine"] and "--coordinator" in argv, argv
    return launcher, engines


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    stack = start_run(tiny_llama, tmp_path_factory.mktemp("engine-start"))
    try:
        yield stack
    finally:
        stack.kill()


async def test_the_engines_are_the_launchers_children_and_serve(stack):
    await stack.wait_engines(2, timeout=300)
    forked_engines(stack)
    completes(stack)


async def test_a_killed_engine_is_restarted_through_the_launcher(stack):
    launcher, (victim, other) = forked_engines(stack)
    os.kill(victim, signal.SIGKILL)
    await until(lambda: victim not in stack.children()["engine"] and len(stack.children()["engine"]) == 2, 120,
                "the killed engine's replacement")
    await stack.wait_engines(2, timeout=300)
    again, engines = forked_engines(stack)
    assert again == launcher and other in engines and victim not in engines  # the same launcher forked it
    completes(stack)


async def test_a_killed_launcher_takes_its_engines_and_they_come_back_from_a_fresh_one(stack):
    launcher, engines = forked_engines(stack)
    os.kill(launcher, signal.SIGKILL)
    await until(lambda: not any(alive(pid) for pid in engines), 60, "the launcher's engines to die with it")
    await until(lambda: len(stack.children()["engine"]) == 2 and len(stack.children()["launcher"]) == 1, 300,
                "the engines' restart")
    await stack.wait_engines(2, timeout=300)
    again, restarted = forked_engines(stack)
    assert again != launcher and not set(restarted) & set(engines)
    assert "engine launcher (pid %d) died (killed by SIGKILL)" % launcher in stack.output()
    completes(stack)


def test_a_killed_run_leaves_nothing(stack):
    pids = stack.pids()
    assert len(pids) == 4, stack.children()  # the coordinator, the launcher and two engines
    os.kill(stack.proc.pid, signal.SIGKILL)
    stack.proc.wait()
    wait_until(lambda: not any(alive(pid) for pid in pids), 60, "every process of the run to go")


async def test_engine_start_exec_starts_fresh_interpreters_as_before(tiny_llama, tmp_path):
    # one engine: each exec'd one is a fresh interpreter importing torch, and one shows where they come from
    stack = start_run(tiny_llama, tmp_path, "--engine-start", "exec", engines=1)
    try:
        await stack.wait_engines(1, timeout=300)
        children = stack.children()
        assert children["launcher"] == [] and len(children["engine"]) == 1, children
        for pid in children["engine"]:
            fields = stat(pid)
            assert int(fields[1]) == stack.proc.pid and int(fields[3]) == pid  # the run's own child, as before
            assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2:4] == [b"megatron_serve.cli", b"engine"]
        completes(stack)
    finally:
        stack.kill()
