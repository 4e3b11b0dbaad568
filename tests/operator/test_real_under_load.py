"""A rolling update and a node drain under a steady load of streamed requests, on the real control plane with real
engine processes: the requests' counts (failed, truncated, repeated, different from an uninterrupted run) and the
longest gap a stream saw.

Real: kube-apiserver, the StatefulSet and disruption controllers, the scheduler, ``kubectl drain`` (the Eviction API
and the fleet's PodDisruptionBudget), the operator as a process with the chart's RBAC; the coordinator and the
engines as processes (the tiny test model on the CPU), the streams through the project's coordinator client.
Simulated: the kubelet. The engine pods go to the test's own GPU nodes, which kwok does not play (no kwok annotation;
:mod:`.real_node` keeps them Ready with a Lease heartbeat), and :class:`Kubelet` plays the kubelet there: it marks a
pod bound to them Running, starts an engine process (``--group`` of the pod) for it, marks it Ready only once that
engine has registered with the coordinator and serves (the engine pods' readiness probe's meaning), sends the engine
SIGTERM when its pod goes (the engine drains: finishes or hands back its requests, which continue elsewhere from their
tokens) and deletes the pod once the engine exited. Nothing marks a pod Ready before its engine serves, so what the
disruption controller counts is what serves: the drain's budget is asserted, not only printed (under kwok, which marks
a replacement Ready the moment it runs, the budget sometimes let both groups go). The operator reconciles every
second.
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
from .real_kubelet import Kubelet, pod_ready, running
from .real_load import STREAMS, Load
from .real_tools import condition, until

pytestmark = [pytest.mark.slow, pytest.mark.scenario, pytest.mark.timeout(900)]

NAME = "tiny"
GROUPS = 2
DEADLINE = 15  # spec.rollout.progressDeadlineSeconds of the bad rollout
#: Seconds each scenario may take under load (they took 11 to 52 s on a loaded 2-core host).
SCENARIO_TIMEOUT = 300
#: What ``kubectl drain`` prints for an eviction the budget refused (the Eviction API's 429); it retries after 5 s.
REFUSED = "would violate the pod's disruption budget"


def held_by_the_budget(timeline: list[tuple[float, str, int, str]], before: set[str]) -> str:
    """Check that the drain let the second group go only after the first group's replacement was Ready (made Ready
    by the kubelet stand-in, so its engine served); returns the order seen, for the printed figures.

    ``timeline`` is the kubelet's (time, "ready" or "going", group, pod uid); ``before`` the engine pods' uids before
    the drain. With the budget the Eviction API lets the second pod go only once the disruption controller counted
    the replacement Ready, which the kubelet wrote after its engine served: the kubelet sees that pod going later
    still. Without a budget both pods go at once, within one of the kubelet's passes, while the replacement's engine
    has not even started (docs/kubernetes/rollouts.md has a run of that control)."""
    going = sorted((t, group) for t, kind, group, uid in timeline if kind == "going" and uid in before)
    assert len(going) == GROUPS, f"the drain's evictions: {going}"
    (first_at, first), (second_at, second) = going
    replaced = [t for t, kind, group, uid in timeline if kind == "ready" and group == first and uid not in before
                and t > first_at]
    assert replaced and replaced[0] < second_at, (
        f"group {second} went {second_at - first_at:.1f}s after group {first}, before group {first}'s replacement "
        f"was Ready ({f'{replaced[0] - first_at:.1f}s after' if replaced else 'never'})")
    return (f"group {first} evicted, its replacement Ready {replaced[0] - first_at:.1f}s later, then group {second} "
            f"evicted {second_at - first_at:.1f}s after the first")


def test_a_rolling_update_and_a_node_drain_under_streamed_load(fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path):
    kubectl = fleet.kubectl
    port = free_port()
    resource = fleet.tiny_resource(NAME, tiny_model)
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["rollout"] = {"progressDeadlineSeconds": DEADLINE}
    resource["spec"]["engine"].update(fleet.gpu_pool(1, kubelet=True))
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
            fleet.gpu_pool(1, first=1, kubelet=True)
            before = {p["metadata"]["uid"] for p in kubelet.pods}
            budget = (kubectl.get("pdb", f"{NAME}-engine") or {}).get("status") or {}
            assert budget.get("disruptionsAllowed") == 1, budget
            fewest = [GROUPS]  # the fewest engine pods Ready at once, sampled at each of the load's polls

            def drained() -> bool:
                fewest[0] = min(fewest[0], sum(running(p) and pod_ready(p) for p in kubelet.pods))
                return drain.poll() is not None and rolled()

            drain = subprocess.Popen([kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain",
                                      f"{kubectl.namespace}-gpu-0", "--ignore-daemonsets", "--delete-emptydir-data",
                                      "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            load = Load(client, expected)
            began = time.monotonic()
            try:
                await under_load(load, drained, "kubectl drain to end and both groups serving on the second node")
            finally:
                if drain.poll() is None:
                    drain.kill()
                output = drain.communicate(timeout=30)[0]
            lines.append(load.line("kubectl drain (2 groups, budget 1)", time.monotonic() - began))
            assert drain.returncode == 0, output
            order = held_by_the_budget(kubelet.timeline, before)
            lines.append(f"drain: evictions refused by the budget (429) {output.count(REFUSED)}; {order}; fewest "
                         f"engine pods Ready at once {fewest[0]}/{GROUPS}")
            lines += [line for line in output.splitlines() if "evict" in line]
            for line in lines:
                print(line)
            assert output.count(REFUSED) >= 1, output  # the Eviction API answered 429 to the second group
            assert fewest[0] == GROUPS - 1, lines
            for node in sorted(fleet.own_nodes):  # kept Ready by their Lease heartbeat all along
                assert condition(kubectl.get("node", node), "Ready").get("status") == "True", node
            for phase in (rolling, bad, load):
                assert phase.failed == [], phase.failed[:3]
                assert (phase.truncated, phase.repeated, phase.different) == (0, 0, 0)
                assert phase.finished > 0
            return lines
        finally:
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        kubelet.stop()
        children.kill_all()
