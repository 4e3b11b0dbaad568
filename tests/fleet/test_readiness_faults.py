"""Readiness that never lies (docs/faults.md, "What each probe answers"), on ``megatron-serve run`` with one engine and
its probe port: each fault of the table, made with real signals to real processes, and what both ports' ``/health``
and ``/ready`` answer meanwhile.

Before (issue 86): with no engine registered ``/ready`` answered 200 with ``"engines": 0`` (45 of 45 probes over
22 s), and the probe port's ``/ready`` stayed 200 for the whole 60 s the API server was SIGSTOPped. The engine is
stopped with SIGSTOP here, which the coordinator sees as a cut link does: a peer that sends nothing and closes
nothing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import pytest

from megatron_serve.limits import READY_STALL_TIMEOUT
from tests.helpers import free_port, http_get
from tests.run_stack import start_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HEARTBEAT_TIMEOUT = 10.0  # the coordinator's default, which run keeps
STATUS_INTERVAL = 0.5


def probe(url: str, path: str) -> tuple[int, dict[str, Any]]:
    answer = http_get(url + path, timeout=5)  # no CA bundle loaded: ~1 ms of CPU a probe, not ~25
    return answer.status_code, answer.json()


def until_status(url: str, path: str, status: int, within: float) -> tuple[float, dict[str, Any]]:
    """Probe ``path`` until it answers ``status``; how long that took, and its body (fails past ``within``)."""
    began = time.monotonic()
    while True:
        got, body = probe(url, path)
        waited = time.monotonic() - began
        if got == status:
            return waited, body
        assert waited < within, f"{path} on {url} still {got} after {waited:.1f}s: {body}"
        time.sleep(0.1)


def test_each_fault_and_what_each_probe_answers(tiny_llama, tmp_path):
    health_port = free_port()
    stack = start_run(tiny_llama, tmp_path, "--health-port", str(health_port), engines=1)
    main, probes = stack.url, f"http://127.0.0.1:{health_port}"
    try:
        for url in (main, probes):
            until_status(url, "/ready", 200, 60)
            assert probe(url, "/ready")[1]["missing"] == [] and probe(url, "/health") == (200, {"status": "ok"})
        engine = stack.one("engine")
        os.kill(engine, signal.SIGSTOP)  # the engine's link as good as cut: nothing from it, nothing closed
        stopped = time.monotonic()
        for url in (main, probes):
            waited, body = until_status(url, "/ready", 503, HEARTBEAT_TIMEOUT + 4 * STATUS_INTERVAL + 5)
            assert body["missing"] == ["engines"] and body["coordinator_reachable"], body
            assert body["detail"] == "no engine can take a request: none is registered with the coordinator", body
            print(f"\n{url}: /ready 503 {time.monotonic() - stopped:.1f}s after the engine stopped")
            assert probe(url, "/health") == (200, {"status": "ok", "missing": ["engines"]})  # alive: no restart
        os.kill(engine, signal.SIGCONT)  # it finds itself dropped and registers again
        for url in (main, probes):
            until_status(url, "/ready", 200, 60)

        os.kill(stack.proc.pid, signal.SIGSTOP)  # run's process is the API server: it owns the main port
        try:
            waited, body = until_status(probes, "/ready", 503, READY_STALL_TIMEOUT + 3)
            print(f"probe port /ready 503 {waited:.1f}s after the API server stopped (deadline "
                  f"{READY_STALL_TIMEOUT:g}s)")
            assert body["missing"] == ["server"] and "the server process has not answered" in body["detail"], body
            health = probe(probes, "/health")
            assert health[0] == 200 and health[1]["missing"] == ["server"], health  # hung only past 30 s
            with pytest.raises(httpx.TimeoutException):  # the control: the main port really does not answer
                http_get(main + "/ready", timeout=1)
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
        until_status(probes, "/ready", 200, 10)
    finally:
        stack.kill()
