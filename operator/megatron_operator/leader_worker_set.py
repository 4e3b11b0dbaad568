"""An engine group as a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``, kubernetes-sigs/lws): one gang.

Where the cluster has the LWS CRD, each group of a resource with ``spec.engine.parallelism`` is one
LeaderWorkerSet ``<name>-engine-<g>`` of one replica: a leader pod (the group's rank 0, which talks to the
coordinator) and ``size - 1`` worker pods, all from the group's pod template. The LWS controller gives each
pod ``LWS_WORKER_INDEX`` (its node rank) and ``LWS_LEADER_ADDRESS``, and makes the headless Service
``<name>-engine-<g>`` through which the ranks meet (so the operator renders none for such a group); its pod
names keep the StatefulSet's leader address (``<name>-engine-<g>-0.<name>-engine-<g>``).

Gang semantics are the controller's: ``RecreateGroupOnPodRestart`` recreates every pod of the group when one
pod is recreated or one container restarts, so the ranks always start together. The workers start with the
leader (``LeaderCreated``), not once it is ready (``LeaderReady``): an engine's readiness is its group being
registered with the coordinator, which needs every rank, so waiting for the leader would never end.
"""

from __future__ import annotations

from typing import Any

from .names import object_meta
from .spec import InferenceSpec

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
CRD_NAME = f"{PLURAL}.{GROUP}"
#: the label the LWS controller puts on every pod: its index in the group (0: the leader)
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def render_engine_lws(spec: InferenceSpec, name: str, group: int, template: dict[str, Any],
                      engines_stopped: bool) -> dict[str, Any]:
    """The LeaderWorkerSet of engine group ``group`` (named ``name``) with pod template ``template``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": object_meta(spec, name, "engine", group),
        "spec": {
            "replicas": 0 if engines_stopped else 1,
            "startupPolicy": "LeaderCreated",
            # one group per LWS: its template changes replace the whole gang, drained by each pod's preStop
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": spec.pods_per_group,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }
