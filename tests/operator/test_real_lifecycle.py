"""Lifecycle verbs end to end: ``kubectl patch`` of a resource on a real API server reaches a real coordinator
and a real engine, and comes back as the resource's status.

What is real: the API server, the StatefulSet controller and scheduler (the engine pod is made, bound and, for
Shutdown, deleted by them), the operator as a process with the chart's ServiceAccount token, and the coordinator and
engine processes (a tiny model on the CPU). What is simulated: the pods run under kwok, so nothing in them runs;
the coordinator and the engine run on this machine instead, and the operator reaches the coordinator through
``MEGATRON_OPERATOR_COORDINATOR_ADDRESS`` (as it would reach one outside its cluster). The test starts and stops the
engine process as the StatefulSet's pod comes and goes, which a kubelet would do.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.helpers import Children, free_port

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_tools import MI, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "tiny"


def _status(fleet: Fleet) -> dict[str, Any]:
    return (fleet.mi(NAME) or {}).get("status") or {}


def _patch(fleet: Fleet, spec: str) -> None:
    fleet.kubectl.run("patch", f"{MI}/{NAME}", "--type=merge", "-p", f'{{"spec": {spec}}}')


def _pods(fleet: Fleet) -> list[str]:
    return [p["metadata"]["name"] for p in fleet.engine_pods(NAME)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def test_lifecycle_verbs_reach_a_real_coordinator_and_engine(fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path):
    kubectl = fleet.kubectl
    port = free_port()
    resource = fleet.tiny_resource(NAME, tiny_model)
    fleet.prerequisites(resource)
    operator = fleet.operator(MEGATRON_OPERATOR_COORDINATOR_ADDRESS=f"tcp://127.0.0.1:{port}")
    kubectl.apply([resource])
    token = fleet.coordinator_token(NAME)

    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}

    def start_engine():
        return children.engine(tiny_model, port, "--group", "0", "--device", "cpu", "--dtype", "float32",
                               "--drain-timeout", "5", env=env)

    def expect(lifecycle: str, phase: str) -> None:
        until(lambda: (s := _status(fleet)).get("phase") == phase and s["lifecycle"].get("observed") == lifecycle,
              120, f"{lifecycle}/{phase}")

    try:
        children.coordinator(tiny_model, port, env=env)
        until(lambda: _pods(fleet), 90, "the engine pod Running (kwok)")
        engine = start_engine()  # the pod's process, here
        until(lambda: _status(fleet).get("phase") == "Ready", 180, "Ready with a real coordinator and engine")
        assert _status(fleet)["engines"] == {"desired": 1, "ready": 1, "connected": 1}
        # the CRD's printer columns, as the API server's table gives them to `kubectl get mi`
        header, row = kubectl.run("get", MI).stdout.splitlines()
        assert header.split() == ["NAME", "PHASE", "LIFECYCLE", "READY", "ENGINES", "ENDPOINT", "AGE"]
        assert row.split()[:5] == [NAME, "Ready", "Running", "1", f"http://{NAME}.{kubectl.namespace}.svc:8000/v1"]
        assert "DESIRED" in kubectl.run("get", MI, "-o", "wide").stdout.splitlines()[0].split()

        _patch(fleet, '{"lifecycle": "Paused", "pauseMode": "Wait"}')
        expect("Paused", "Paused")
        _patch(fleet, '{"lifecycle": "Suspended"}')
        expect("Suspended", "Suspended")
        _patch(fleet, '{"lifecycle": "Running"}')
        expect("Running", "Ready")
        acks = [e["message"] for e in kubectl.events(NAME) if e.get("reason") == "Lifecycle"]
        assert [m.split(" ")[0] for m in acks] == ["PAUSE", "SUSPEND", "RESUME", "UNPAUSE"], acks
        assert acks[0].startswith("PAUSE (wait) acknowledged"), acks[0]  # spec.pauseMode reached the coordinator

        # Shutdown: STOP first (the engine drains and exits), then the real StatefulSet controller deletes the pod
        _patch(fleet, '{"lifecycle": "Shutdown"}')
        until(lambda: _status(fleet).get("phase") == "Shutdown", 120, "Shutdown")
        engine.wait(timeout=60)
        assert engine.returncode == 0, children.log_of(engine)[-2000:]
        until(lambda: not fleet.engine_pods(NAME), 60, "the engine pod deleted by the StatefulSet controller")
        assert kubectl.get("statefulset", f"{NAME}-engine-0")["spec"]["replicas"] == 0

        # back to Running: the controller makes the pod again, its process starts, UNPAUSE restarts the fleet
        _patch(fleet, '{"lifecycle": "Running"}')
        until(lambda: _pods(fleet), 90, "the engine pod back")
        engine = start_engine()
        expect("Running", "Ready")

        # kubectl delete: the finalizer STOPs the fleet (the engine drains and exits) before the collector runs
        kubectl.run("delete", f"{MI}/{NAME}", "--timeout=90s")
        engine.wait(timeout=60)
        assert engine.returncode == 0
        until(lambda: not fleet.engine_pods(NAME), 60, "the engine pod collected")
        assert "Traceback" not in operator.log(), operator.log()[-3000:]
    finally:
        children.kill_all()
