"""The coordinator container's liveness probe asks the coordinator's loop with a deadline: rendered as an exec of
``python -m megatron_operator.probe coordinator``, and run here against a real coordinator process that is stopped
(SIGSTOP) and woken. The control is what the probe was before, a TCP connection to the port: the kernel completes it
for a stopped process, so it passed while the coordinator answered nobody (issue 86)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_operator.names import COORDINATOR_PORT
from megatron_operator.probe import COORDINATOR_DEADLINE
from megatron_operator.render import render

from ..helpers import Children, free_port
from .helpers import ROOT, load_yaml
from .test_operator_render import CONFIG, _containers, by_key, identified

PROBE = ["python", "-m", "megatron_operator.probe", "coordinator"]


def _coordinator_container() -> dict:
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "rl-rollout-paused.yaml")
    objs = by_key(render(identified(resource), CONFIG))
    coordinator, _server = _containers(objs[("Deployment", "rollout-coordinator")])
    return coordinator


def test_the_coordinator_liveness_probe_asks_its_loop_within_a_deadline():
    coordinator = _coordinator_container()
    liveness = coordinator["livenessProbe"]
    assert liveness["exec"]["command"] == PROBE and "tcpSocket" not in liveness
    # the probe's own deadline, with room for the probe process to start, fits the kubelet's timeout
    assert COORDINATOR_DEADLINE + 3 <= liveness["timeoutSeconds"]
    # a hung coordinator is restarted within a minute; a slow probe once (a loaded node) restarts nothing
    assert liveness["failureThreshold"] >= 2 and liveness["periodSeconds"] * liveness["failureThreshold"] <= 60
    # the probe's default address is this container's own port (the coordinator pod sets no address for it)
    assert coordinator["args"][coordinator["args"].index("--port") + 1] == str(COORDINATOR_PORT)
    assert not any(e["name"] == "MEGATRON_SERVE_COORDINATOR" for e in coordinator["env"])


def _probe(address: str, token: str) -> tuple[int, float, str]:
    """The rendered command, run as the kubelet runs it (another process, the pod's environment): its exit status,
    its seconds and its words."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, *PROBE[1:]], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MEGATRON_SERVE_COORDINATOR": address, "MEGATRON_SERVE_TOKEN": token})
    return done.returncode, time.monotonic() - started, done.stdout + done.stderr


def _tcp_connects(port: int) -> bool:
    """What a ``tcpSocket`` probe checks."""
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return True


@pytest.mark.timeout(300)
def test_a_stopped_coordinator_fails_the_probe_within_its_deadline(tiny_model, tmp_path):
    children = Children(tmp_path)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = children.coordinator(tiny_model, port)
    try:
        deadline = time.monotonic() + 120
        while (answer := _probe(address, children.secret))[0] != 0:
            children.check_running()
            assert time.monotonic() < deadline, f"the coordinator never answered the probe: {answer[2]}"
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert _tcp_connects(port)  # the control: the old probe passed a stopped coordinator
            rc, seconds, words = _probe(address, children.secret)
            timeout = _coordinator_container()["livenessProbe"]["timeoutSeconds"]
            assert rc == 1, words
            assert "did not answer within" in words
            assert seconds < timeout, f"the probe took {seconds:.1f}s, past the kubelet's {timeout}s"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        rc, _, words = _probe(address, children.secret)  # woken, it answers again: no restart for a pause
        assert rc == 0, words
    finally:
        children.kill_all()
