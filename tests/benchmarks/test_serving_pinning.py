"""``benchmarks/serving_stack.py``'s ``--pin-coordinator`` layout: the coordinator alone on the last core, every other
process of the stack on the rest. Its CPU per token was the benchmark's least stable figure (13-47 run to run) while it
shared a core with the HTTP server and the benchmark's client, whose memory its every wake-up found in the caches."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.benchmarks.scripts import script_fixture

serving_stack = script_fixture("serving_stack", "serving_stack_benchmark", "serving_stack.py")


@pytest.mark.parametrize(("cores", "engines", "layout"), [
    ([0, 1], 1, ([0], [0], [0], [1])),  # too few for an engine core: everything else shares core 0
    ([0, 1, 2, 3], 2, ([1, 2], [0], [0, 1, 2], [3])),
    ([0, 1, 2, 3], 1, ([2], [0, 1], [0, 1, 2], [3])),
])
def test_the_coordinator_gets_the_last_core_alone(serving_stack, monkeypatch, cores, engines, layout):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    plan = serving_stack.Pinning.plan(engines, pin=True, own_coordinator=True)
    assert (plan.engines, plan.front, plan.cores, plan.coordinator) == layout
    assert serving_stack.Pinning.plan(engines, pin=False, own_coordinator=True).engines is None  # --no-pin wins
    assert serving_stack.Pinning.plan(engines, pin=True).coordinator is None  # the default layout is unchanged


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_stack_is_pinned_by_role(serving_stack):
    """A stand-in for ``megatron-serve run``: a process whose child is neither an engine nor an API server, the role
    ``stack_processes`` gives the coordinator. Pinned, the child runs on the coordinator's core alone, the parent on
    the others'."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               "subprocess.run(['sleep', '60'], stdin=sys.stdin)"], stdin=subprocess.PIPE)
    try:
        child = None
        while child is None:  # its child appears once the interpreter has started
            children = serving_stack.stack_processes(parent.pid)
            child = children[0][0] if children else None
            assert parent.poll() is None
            time.sleep(0.01)
        assert children == [(child, "coordinator")]
        plan = serving_stack.Pinning.plan(1, pin=True, own_coordinator=True)
        serving_stack.pin_stack(parent.pid, plan)
        assert os.sched_getaffinity(child) == set(plan.coordinator)
        assert os.sched_getaffinity(parent.pid) == set(plan.front)
        assert set(plan.coordinator).isdisjoint(plan.front + plan.cores)
    finally:
        if child is not None:
            os.kill(child, 9)
        parent.kill()
        parent.wait()
