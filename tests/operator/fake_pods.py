"""What the StatefulSet and LeaderWorkerSet controllers and the kubelet do, for the gang tests: each
engine workload gets its pods (named and labelled as those controllers name and label them), the pods
run ready, and the workload's status counts them.

Not modelled: the LeaderWorkerSet controller's own restart policy (``RecreateGroupOnPodRestart`` is the
controller's job, asserted in the rendered object); a deleted pod comes back under a new uid, as the
StatefulSet controller does.

Like a real controller it acts on a view that may be stale: the operator can delete a workload (a gang moving
to a LeaderWorkerSet, a group scaled away) while its pods are being made. A workload or pod gone meanwhile is
skipped (the pods made for a deleted workload are the API server's garbage); any other error ends the loop and
:meth:`PodController.stop` raises it, so a test sees why its pods stopped coming.

What still needs it: ``test_gang.py``, whose tests run on the emulator (see its docstring) and restart one rank
while the others keep running (a container restart counted in ``restartCount``, which kwok does not play); the real
StatefulSet and LeaderWorkerSet controllers make and place the gangs' pods in ``test_real_layouts.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from megatron_operator import leader_worker_set as lws

from .helpers import Cluster

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def _owner(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
             "uid": obj["metadata"]["uid"], "controller": True}]


def wanted_pods(obj: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The pods a workload wants: name -> labels."""
    spec = obj["spec"]
    name = obj["metadata"]["name"]
    if obj["kind"] == "StatefulSet":
        labels = spec["template"]["metadata"]["labels"]
        return {f"{name}-{i}": dict(labels) for i in range(int(spec.get("replicas", 1)))}
    template = spec["leaderWorkerTemplate"]
    labels = template["workerTemplate"]["metadata"]["labels"]
    out = {}
    for replica in range(int(spec.get("replicas", 1))):
        for index in range(int(template.get("size", 1))):
            pod = f"{name}-{replica}" if index == 0 else f"{name}-{replica}-{index}"
            out[pod] = {**labels, LWS_NAME_LABEL: name, LWS_GROUP_INDEX_LABEL: str(replica),
                        lws.WORKER_INDEX_LABEL: str(index)}
    return out


def _ready_status() -> dict[str, Any]:
    return {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0}]}


class PodController:
    """Keeps the pods of every StatefulSet and LeaderWorkerSet in ``namespace`` (the cluster's own fake
    controllers must hold those workloads: this one writes their status from their pods)."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.cluster = cluster
        self.namespace = namespace
        self.task: asyncio.Task[None] | None = None

    async def _set_status(self, plural: str, name: str, status: dict[str, Any]) -> None:
        try:
            await self.cluster.emu.set_status(plural, self.namespace, name, status)
        except KeyError:  # deleted since this pass read it: the next pass sees what is there now
            pass

    async def sync(self, obj: dict[str, Any]) -> None:
        """One workload (as last read): its pods made, surplus ones deleted, its status counted."""
        c, ns = self.cluster, self.namespace
        want = wanted_pods(obj)
        pods = {p["metadata"]["name"]: p for p in c.emu.objects_of("pods", ns)
                if any(r.get("uid") == obj["metadata"]["uid"] for r in p["metadata"].get("ownerReferences") or [])}
        for name, labels in want.items():
            if name not in pods:
                await c.must("POST", f"/api/v1/namespaces/{ns}/pods", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": ns, "labels": labels, "ownerReferences": _owner(obj)},
                    "spec": {"nodeName": f"node-{name}", "containers": [{"name": "engine", "image": "x"}]}},
                    expect=(201, 409))
                await self._set_status("pods", name, _ready_status())
        for name in set(pods) - set(want):
            await c.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")
        ready = sum(1 for p in c.emu.objects_of("pods", ns) if p["metadata"]["name"] in want and any(
            cond.get("type") == "Ready" and cond.get("status") == "True"
            for cond in (p.get("status") or {}).get("conditions") or []))
        replicas = int(obj["spec"].get("replicas", 1))
        complete = ready == len(want)
        if obj["kind"] == "StatefulSet":
            counted = {"replicas": len(want), "readyReplicas": ready, "updatedReplicas": len(want),
                       "availableReplicas": ready}
        else:  # a LeaderWorkerSet counts groups: ready when every pod of the group is
            counted = {"replicas": replicas, "readyReplicas": replicas if complete else 0, "updatedReplicas": replicas}
        plural = "statefulsets" if obj["kind"] == "StatefulSet" else lws.PLURAL
        await self._set_status(plural, obj["metadata"]["name"],
                               {"observedGeneration": obj["metadata"]["generation"], **counted})

    async def _loop(self) -> None:
        emu = self.cluster.emu
        seen = -1
        while True:
            # react to changes; also re-check now and then (tests release held workloads)
            await emu.wait_until(lambda: emu.rv != seen, 0.2)
            seen = emu.rv
            for plural in ("statefulsets", lws.PLURAL):
                for obj in emu.objects_of(plural, self.namespace):
                    await self.sync(obj)
            seen = emu.rv

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Cancel the loop; raise what ended it if it ended on its own (a test's failure shows the cause)."""
        if self.task is None:
            return
        task, self.task = self.task, None
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if not isinstance(outcome, (asyncio.CancelledError, type(None))):
            raise RuntimeError("the fake pod controller died") from outcome
