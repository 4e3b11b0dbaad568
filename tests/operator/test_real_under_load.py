"""A rolling update and a node drain under a steady load of streamed requests, on the real control plane with real
engine processes: the requests' counts (failed, truncated, repeated, different from an uninterrupted run) and the
longest gap a stream saw.

Real: kube-apiserver, the StatefulSet and disruption controllers, the scheduler, ``kubectl drain`` (the Eviction API
and the fleet's PodDisruptionBudget), the operator as a process with the chart's RBAC; the coordinator and the
engines as processes (the tiny test model on the CPU), the streams through the project's coordinator client.
Simulated: the pods run under kwok, with no kubelet, so :class:`Kubelet` plays its part for the engine pods: it
starts an engine process (``--group`` of the pod) for each Running engine pod, sends SIGTERM to it (the engine
drains: finishes or hands back its requests, which continue elsewhere from their tokens) when its pod goes, and
keeps the pod not Ready until its engine has registered with the coordinator (the engine pods' readiness probe's
meaning). kwok marks a new pod Ready the moment it runs, so there is a short window (a watch event's latency) in
which a pod counts as Ready before its engine registered; the operator reconciles every second.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import time
from typing import Any

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from tests.helpers import Children, free_port

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_kubelet import Kubelet
from .real_load import STREAMS, Load
from .real_tools import condition, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "tiny"
GROUPS = 2
DEADLINE = 15  # spec.rollout.progressDeadlineSeconds of the bad rollout
#: Seconds each scenario may take under load (they took 11 to 52 s on a loaded 2-core host).
SCENARIO_TIMEOUT = 300


def test_a_rolling_update_and_a_node_drain_under_streamed_load(fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path):
    kubectl = fleet.kubectl
    port = free_port()
    resource = fleet.tiny_resource(NAME, tiny_model)
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["rollout"] = {"progressDeadlineSeconds": DEADLINE}
    resource["spec"]["engine"].update(fleet.gpu_pool(1))
    fleet.prerequisites(resource)
    fleet.operator(MEGATRON_OPERATOR_COORDINATOR_ADDRESS=f"tcp://127.0.0.1:{port}")
    kubectl.apply([resource])
    token = fleet.coordinator_token(NAME)
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}
    children.coordinator(tiny_model, port, env=env)
    kubelet = Kubelet(fleet, children, tiny_model, port, env, name=NAME).start()

    def patch(spec: dict[str, Any]) -> int:
        """``kubectl patch`` of the resource's spec; returns the generation it made."""
        kubectl.run("patch", "mi", NAME, "--type=merge", "-p", json.dumps({"spec": spec}))
        return int(fleet.mi(NAME)["metadata"]["generation"])

    def progressing(reason: str, generation: int) -> bool:
        """The resource's Progressing condition has ``reason`` for ``generation`` (not a stale one of before)."""
        found = condition(fleet.mi(NAME), "Progressing")
        return found.get("reason") == reason and int(found.get("observedGeneration") or 0) >= generation

    async def under_load(load: Load, done: Any, what: str) -> None:
        await load.run_until(done, SCENARIO_TIMEOUT, what, check=kubelet.check, context=kubelet.describe)

    async def scenario() -> list[str]:
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=token)
        await client.start(timeout=60)
        lines = []
        try:
            await asyncio.to_thread(until, lambda: (kubelet.check(), kubelet.serving(GROUPS))[1], SCENARIO_TIMEOUT,
                                    f"{GROUPS} engine groups serving")
            expected: dict[int, list[int]] = {}
            warm = Load(client, expected)  # the uninterrupted run: each slot's answer, then the same answer again
            await under_load(warm, lambda: len(expected) == STREAMS and warm.finished >= 2 * STREAMS,
                             f"{2 * STREAMS} streams of the uninterrupted run, each slot's among them")
            assert warm.failed == [] and warm.finished > 0, warm.failed[:3]

            # a rolling update: a new image tag
            before = {p["metadata"]["uid"] for p in kubelet.pods}
            generation = patch({"image": "example.com/x:v2"})
            load = Load(client, expected)
            began = time.monotonic()

            def rolled() -> bool:
                return kubelet.serving(GROUPS) and not {p["metadata"]["uid"] for p in kubelet.pods} & before

            await under_load(load, lambda: rolled() and progressing("Complete", generation),
                             "every group on the new template, serving, and Progressing Complete")
            lines.append(load.line("rolling update (2 groups)", time.monotonic() - began))
            rolling = load

            # a bad rollout: a GPU no node has; group 0 moves, is never placed, the rollout halts; then a revert
            generation = patch({"engine": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}})
            load = Load(client, expected)
            began = time.monotonic()
            await under_load(load, lambda: progressing("ProgressDeadlineExceeded", generation),
                             "Progressing=False ProgressDeadlineExceeded")
            halted_after = time.monotonic() - began
            generation = patch({"engine": {"nodeSelector": {"nvidia.com/gpu.product": None}}})
            await under_load(load, lambda: kubelet.serving(GROUPS) and progressing("Complete", generation),
                             "the reverted groups serving and Progressing Complete")
            lines.append(load.line(f"bad rollout halted after {halted_after:.0f}s (deadline {DEADLINE}s), reverted",
                                   time.monotonic() - began))
            bad = load

            # a node drain: both groups' pods on the pool's first node, a second node for their replacements
            fleet.gpu_pool(2)
            before = {p["metadata"]["uid"] for p in kubelet.pods}
            budget = kubectl.get("pdb", f"{NAME}-engine").get("status")
            drain = subprocess.Popen([kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain",
                                      f"{kubectl.namespace}-gpu-0", "--ignore-daemonsets", "--delete-emptydir-data",
                                      "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            load = Load(client, expected)
            began = time.monotonic()
            try:
                await under_load(load, lambda: drain.poll() is not None and rolled(),
                                 "kubectl drain to end and both groups serving on the second node")
            finally:
                if drain.poll() is None:
                    drain.kill()
                output = drain.communicate(timeout=30)[0]
            lines.append(load.line("kubectl drain (2 groups, budget 1)", time.monotonic() - began))
            assert drain.returncode == 0, output
            lines.append(f"drain: evictions refused by the budget {output.count('disruption budget')}; budget "
                         f"before: {budget}")
            lines += [line for line in output.splitlines() if "evict" in line]
            for line in lines:
                print(line)
            for phase in (rolling, bad, load):
                assert phase.failed == [], phase.failed[:3]
                assert (phase.truncated, phase.repeated, phase.different) == (0, 0, 0)
                assert phase.finished > 0
            # Whether the budget refused the second eviction depends on the race described in the module (a
            # replacement counted Ready by kwok before its engine registered lets it through): printed, not asserted.
            return lines
        finally:
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        kubelet.stop()
        children.kill_all()
