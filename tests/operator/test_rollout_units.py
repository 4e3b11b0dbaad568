"""The pure parts of halted rollouts and exact templates (:mod:`megatron_operator.rollout_deadline`,
:mod:`megatron_operator.templates`) and the order in which groups take a new template (:mod:`.reconcile`)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from megatron_operator import reconcile, rollout_deadline, templates

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


def test_exact_deletes_the_map_keys_the_rendering_dropped_and_replaces_lists():
    have = {"nodeSelector": {"pool": "a", "gpu": "B200"}, "containers": [{"name": "e", "args": ["x"]}], "dns": "x"}
    want = {"nodeSelector": {"pool": "a"}, "containers": [{"name": "e", "args": ["y"]}]}
    assert templates.exact(want, have) == {"nodeSelector": {"gpu": None, "pool": "a"},
                                           "containers": [{"name": "e", "args": ["y"]}], "dns": None}


def test_the_pods_own_reason_comes_first_then_the_schedulers():
    crashing = {"metadata": {"name": "g-0"}, "status": {"containerStatuses": [{
        "name": "engine", "ready": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"reason": "Error", "message": "model refused: unknown architecture Foo"}}}]}}
    assert rollout_deadline.pod_reason([crashing]) == \
        "pod g-0 container engine: model refused: unknown architecture Foo"
    pending = {"metadata": {"name": "g-0"}, "status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available"}]}}
    assert rollout_deadline.pod_reason([pending]) == "pod g-0 cannot be scheduled: 0/3 nodes are available"
    assert rollout_deadline.pod_reason([{"metadata": {"name": "g-0"}, "status": {}}]) == ""


class _Kube:
    """The API calls of one pass, over a dict of live objects (the real API server is in test_real_rollout.py)."""

    def __init__(self, live: dict[str, dict[str, Any]]):
        self.live = live
        self.patched: list[str] = []

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.live.get(name)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> Any:
        self.patched.append(name)
        return self.live[name]

    async def list(self, *args: Any) -> list[dict[str, Any]]:
        return []


def _sts(group: int, image: str, ready: bool, since: str | None = None) -> dict[str, Any]:
    template = {"spec": {"containers": [{"name": "engine", "image": image}]}}
    annotations = {templates.TEMPLATE_HASH: templates.template_hash(template)}
    if since:
        annotations[rollout_deadline.ANNOTATION] = since
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": f"x-engine-{group}", "namespace": "ns", "generation": 1, "annotations": annotations,
                         "labels": {reconcile.names.GROUP_LABEL: str(group)}},
            "spec": {"replicas": 1, "template": template},
            "status": {"observedGeneration": 1, "readyReplicas": 1 if ready else 0, "updatedReplicas": 1}}


def _desired(image: str) -> list[dict[str, Any]]:
    """As render makes them: no status, no annotations of the operator's."""
    objects = [{k: v for k, v in _sts(g, image, True).items() if k != "status"} for g in range(3)]
    for obj in objects:
        del obj["metadata"]["annotations"]
    return objects


def test_a_revert_rolls_the_group_that_is_not_ready_back_first_then_one_at_a_time():
    # groups 0 and 1 moved to v2; 1 never became Ready; the spec is back at v1
    kube = _Kube({"x-engine-0": _sts(0, "v2", True), "x-engine-1": _sts(1, "v2", False),
                  "x-engine-2": _sts(2, "v1", True)})
    result = asyncio.run(reconcile.Reconciler(kube).children(_desired("v1"), name="x", namespace="ns", uid=None,
                                                             now=NOW))
    assert kube.patched == ["x-engine-1"] and result.deferred == ["x-engine-0"]


def test_a_group_past_the_deadline_is_halted_and_the_next_one_waits():
    since = (NOW - datetime.timedelta(seconds=601)).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube = _Kube({"x-engine-0": _sts(0, "v2", False, since), "x-engine-1": _sts(1, "v1", True),
                  "x-engine-2": _sts(2, "v1", True)})
    result = asyncio.run(reconcile.Reconciler(kube).children(_desired("v2"), name="x", namespace="ns", uid=None,
                                                             progress_deadline_seconds=600, now=NOW))
    assert [h.workload for h in result.halted] == ["x-engine-0"] and result.halted[0].waited_s == 601
    assert kube.patched == [] and result.deferred == ["x-engine-1", "x-engine-2"]
    # within the deadline: rolling, not halted
    result = asyncio.run(reconcile.Reconciler(kube).children(_desired("v2"), name="x", namespace="ns", uid=None,
                                                             progress_deadline_seconds=602, now=NOW))
    assert result.halted == [] and result.rolling == ["x-engine-0"]


def test_a_group_whose_controller_saw_its_new_template_but_whose_old_pod_still_runs_is_rolling():
    """The StatefulSet controller's first status after a template change: observedGeneration caught up, the old pod
    still counted Ready, and ``updatedReplicas`` 0, which the API server leaves out of the object (omitempty). The
    group is rolling: the next group waits (reading the missing field as all replicas updated once moved both groups
    of a real cluster's fleet at once, and a bad template took every engine down)."""
    moved = _sts(0, "v2", True)
    del moved["status"]["updatedReplicas"]
    kube = _Kube({"x-engine-0": moved, "x-engine-1": _sts(1, "v1", True), "x-engine-2": _sts(2, "v1", True)})
    result = asyncio.run(reconcile.Reconciler(kube).children(_desired("v2"), name="x", namespace="ns", uid=None,
                                                             now=NOW))
    assert kube.patched == [] and result.rolling == ["x-engine-0"]
    assert result.deferred == ["x-engine-1", "x-engine-2"]
