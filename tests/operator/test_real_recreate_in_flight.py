"""An engine StatefulSet recreated for an immutable field with streamed requests in flight: every stream completes,
and its greedy tokens equal an uninterrupted run's.

The immutable field: the StatefulSet of engine group 0 is replaced (by the test, while no operator runs) with one
that differs from what the operator renders in ``podManagementPolicy`` (``OrderedReady``), as an older operator
version would have left it; the test then starts the operator, as an upgrade does. Its patch gets the real API
server's 422 ("field is immutable"), and it deletes the StatefulSet with ``propagationPolicy: Orphan`` and creates it
again: the garbage collector takes the old StatefulSet's ownerReference off the pod, and the new StatefulSet's
controller adopts the pod (its name and labels are the new one's). The pod is never deleted.

What is real: the API server (its 422), the garbage collector's orphaning, the StatefulSet controller's adoption, the
operator as a process with the chart's ServiceAccount token, and the coordinator and engine processes (the tiny
model on the CPU), with streams through the project's coordinator client. Simulated: the kubelet. The pod goes to
a GPU node of the test's own that kwok does not play (``real_node`` keeps it Ready with a Lease heartbeat), where
``real_kubelet.Kubelet`` plays its kubelet: it marks the pod Running, starts the engine process, marks the pod Ready
only once the engine registered and serves, sends it SIGTERM (the engine drains and hands its requests back) when the
pod is being deleted, and deletes the pod once the engine exited. ``real_load.Load`` keeps 32 streams going,
one request after another per slot, so requests are in flight at every moment of the recreate. Asserted: the pod is
the same pod (same uid) before and after, now owned by the new StatefulSet; its engine was started once and never
signalled; every stream completed with the uninterrupted run's greedy tokens, none failed, truncated or repeated.

The control: the StatefulSet deleted as ``kubectl delete`` deletes (the garbage collector's default, background
propagation, which the operator used before) and recreated by the operator: the pod goes with it, its engine gets
SIGTERM, a new pod and engine come, and the streams wait for the new engine (their longest wait for a token exceeds
the recreate's; both printed). Under kwok the old pod was gone at once and its replacement Ready the moment it ran,
while the old engine still drained; here, as with a kubelet, the replacement of the same name comes only once the old
engine exited, and is Ready only once the new engine serves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import free_port

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_engines import EnginesHere, engines_here  # noqa: F401 - the fixture
from .real_load import Load
from .real_tools import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "tiny"
ENGINE = f"{NAME}-engine-0"
#: Seconds a scenario may take under load
SCENARIO_TIMEOUT = 180


def _uid(obj: dict[str, Any] | None) -> str | None:
    return (obj or {}).get("metadata", {}).get("uid")


def _owner(pod: dict[str, Any] | None) -> str | None:
    refs = (pod or {}).get("metadata", {}).get("ownerReferences", [])
    return next((r["uid"] for r in refs if r.get("controller")), None)


def _pod(fleet: Fleet) -> dict[str, Any] | None:
    return fleet.kubectl.get("pod", f"{ENGINE}-0")


def _older_statefulset(fleet: Fleet) -> str:
    """Replace the operator's StatefulSet of group 0 by one with ``podManagementPolicy: OrderedReady`` (an older
    operator's), its pod kept and adopted by it; returns its uid."""
    kubectl = fleet.kubectl
    live = kubectl.get("statefulset", ENGINE)
    meta = {k: v for k, v in live["metadata"].items()
            if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}
    older = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
             "spec": {**live["spec"], "podManagementPolicy": "OrderedReady"}}
    kubectl.run("delete", "statefulset", ENGINE, "--cascade=orphan", "--wait=true")
    kubectl.apply([older])
    uid = _uid(kubectl.get("statefulset", ENGINE))
    until(lambda: _owner(_pod(fleet)) == uid, 60, "the pod adopted by the older StatefulSet")
    return uid


def test_an_immutable_field_recreate_keeps_the_pods_and_the_streams_in_flight(
        fleet: Fleet, tiny_model: str, engines_here: Callable[[int, str], EnginesHere]):
    kubectl = fleet.kubectl
    port = free_port()
    resource = fleet.tiny_resource(NAME, tiny_model)
    resource["spec"]["engine"].update(fleet.gpu_pool(1, kubelet=True))
    fleet.prerequisites(resource)
    address = {"MEGATRON_OPERATOR_COORDINATOR_ADDRESS": f"tcp://127.0.0.1:{port}"}
    first = fleet.operator(**address)
    kubectl.apply([resource])
    # exec'd engines: the control below needs a new engine's start to be slower than the in-place path's worst gap,
    # which an engine forked from a launcher (under a second to serving) is not on a loaded machine
    here = engines_here(port, NAME, fork=False)
    kubelet = here.kubelet

    async def scenario() -> None:
        async with here.client() as client:
            await asyncio.to_thread(until, lambda: (kubelet.check(), kubelet.serving(1))[1], SCENARIO_TIMEOUT,
                                    "the engine pod Running with its engine serving")
            await asyncio.to_thread(until, lambda: ((fleet.mi(NAME) or {}).get("status") or {}).get("phase")
                                    == "Ready", SCENARIO_TIMEOUT, "the resource Ready")
            first.stop()
            older = await asyncio.to_thread(_older_statefulset, fleet)
            pod = _uid(_pod(fleet))
            assert set(kubelet.engines) == {pod} and kubelet.told == set()

            expected: dict[int, list[int]] = {}
            warm = Load(client, expected)  # the uninterrupted run, for reference
            await warm.run_until(lambda: warm.finished >= 64, SCENARIO_TIMEOUT, "64 streams of the uninterrupted run",
                                 check=kubelet.check, context=kubelet.describe)
            assert warm.failed == [], warm.failed[:3]

            async def under_load(label: str, change: Callable[[], Any], done: Callable[[], bool], what: str) -> Load:
                """``change()`` with the streams in flight; they go on until ``done()``."""
                load = Load(client, expected)
                began = time.monotonic()
                run = asyncio.create_task(load.run_until(done, SCENARIO_TIMEOUT, what, check=kubelet.check,
                                                         context=kubelet.describe))
                await asyncio.sleep(1)
                await asyncio.to_thread(change)
                await run
                print(load.line(label, time.monotonic() - began))
                return load

            # the upgraded operator: its first pass meets the older StatefulSet, gets 422, recreates it
            def adopted() -> bool:
                live = kubectl.get("statefulset", ENGINE)
                return _uid(live) not in (None, older) and _owner(_pod(fleet)) == _uid(live)

            load = await under_load("the operator's recreate (pods orphaned and adopted)",
                                    lambda: fleet.operator(**address), adopted,
                                    "the StatefulSet recreated, the pod adopted by it")
            assert load.failed == [], load.failed[:3]
            assert (load.truncated, load.repeated, load.different) == (0, 0, 0) and load.finished > 0
            new = kubectl.get("statefulset", ENGINE)
            assert new["spec"]["podManagementPolicy"] == "Parallel"
            kept = _pod(fleet)
            assert _uid(kept) == pod and _owner(kept) == _uid(new)  # the same pod, now the new StatefulSet's
            assert set(kubelet.engines) == {pod} and kubelet.told == set()  # its engine served on, never signalled
            recreating = [e["message"] for e in kubectl.events(NAME) if e.get("reason") == "Recreating"]
            assert recreating and "its pods kept for the new one" in recreating[0], recreating

            # the control: the StatefulSet deleted with the garbage collector's default (background) propagation,
            # as the operator deleted it before: the pod goes with it, its engine gets SIGTERM, a new pod and engine
            # come with the StatefulSet the operator recreates
            control = await under_load("control: the StatefulSet deleted in the background",
                                       lambda: kubectl.run("delete", "statefulset", ENGINE, "--wait=false"),
                                       lambda: _uid(_pod(fleet)) not in (None, pod) and kubelet.serving(1),
                                       "a new pod with a new engine serving")
            assert pod in kubelet.told and len(kubelet.engines) == 2
            assert control.worst_gap > load.worst_gap  # the streams waited for the new engine
            # and lost nothing: the old engine drained, handing back what it had, continued on the new one
            assert control.failed == [], control.failed[:3]
            assert (control.truncated, control.repeated, control.different) == (0, 0, 0) and control.finished > 0

    asyncio.run(scenario())
