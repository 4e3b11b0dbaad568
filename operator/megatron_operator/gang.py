"""The ranks of engine groups rendered as gangs (``spec.engine.parallelism``): their status, and the
restart of a whole StatefulSet group when one of its ranks restarted (pure).

A group's ranks meet once, at start-up; a rank that comes back alone finds no peers, and peers that
lost it wait in a collective. A LeaderWorkerSet recreates the whole group itself
(``RecreateGroupOnPodRestart``). For a StatefulSet group the operator does it: ``status.groups[].startedWith``
records the pods (uid and engine restarts, by rank) the group last ran with, complete; when some of
those pods were recreated or restarted and others were not, :func:`plan` names the others for deletion,
so every rank starts again together. Any earlier record only makes more pods look restarted (uids never
come back, restart counts only grow), so a stale status never deletes a pod that a restart left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import leader_worker_set as lws
from .names import GROUP_LABEL, engine_name

ENGINE_CONTAINER = "engine"


@dataclass(frozen=True)
class RankPod:
    """One pod of a group, as observed."""

    rank: int  # node rank: 0 leads
    pod: str
    uid: str
    ready: bool
    restarts: int  # of the engine container
    terminating: bool
    node_name: str | None

    def entry(self, gpus_per_pod: int) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "firstRank": self.rank * gpus_per_pod, "pod": self.pod,
                               "podUID": self.uid, "ready": self.ready, "restarts": self.restarts}
        if self.node_name:
            out["nodeName"] = self.node_name
        return out


def _node_rank(pod: dict[str, Any], workload: str, group_name: str) -> int | None:
    meta = pod.get("metadata") or {}
    if workload == lws.KIND:
        text = (meta.get("labels") or {}).get(lws.WORKER_INDEX_LABEL, "")
    else:  # a StatefulSet pod is named <statefulset>-<ordinal>
        name = meta.get("name", "")
        text = name[len(group_name) + 1:] if name.startswith(group_name + "-") else ""
    return int(text) if text.isdigit() else None


def _rank_pod(pod: dict[str, Any], rank: int) -> RankPod:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []
                   if c.get("name") == ENGINE_CONTAINER)
    return RankPod(rank=rank, pod=meta.get("name", ""), uid=meta.get("uid", ""), ready=ready, restarts=restarts,
                   terminating=bool(meta.get("deletionTimestamp")),
                   node_name=(pod.get("spec") or {}).get("nodeName"))


def group_pods(pods: list[dict[str, Any]], name: str, groups: int, workload: str) -> dict[int, list[RankPod]]:
    """The engine pods of resource ``name`` by group (0 .. groups-1), each group's by node rank."""
    out: dict[int, list[RankPod]] = {g: [] for g in range(groups)}
    for pod in pods:
        text = ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL, "")
        if not text.isdigit() or int(text) not in out:
            continue
        group = int(text)
        rank = _node_rank(pod, workload, engine_name(name, group))
        if rank is not None:
            out[group].append(_rank_pod(pod, rank))
    return {g: sorted(ranks, key=lambda r: (r.rank, r.terminating)) for g, ranks in out.items()}


def _recorded(previous: dict[str, Any] | None) -> dict[int, tuple[str, int]]:
    return {int(m["rank"]): (str(m.get("podUID", "")), int(m.get("restarts", 0)))
            for m in (previous or {}).get("startedWith") or [] if isinstance(m, dict) and "rank" in m}


def plan(previous: dict[str, Any] | None, ranks: list[RankPod], size: int) -> tuple[list[str], list[dict[str, Any]]]:
    """For one StatefulSet group of ``size`` pods: (pods to delete, the new ``startedWith`` record).

    ``previous`` is the group's entry in the last status. The record moves only when all ``size`` ranks run
    (no pod missing or terminating) and nothing is to be deleted.
    """
    record = _recorded(previous)
    live = [r for r in ranks if not r.terminating]
    old = [{"rank": rank, "podUID": uid, "restarts": restarts} for rank, (uid, restarts) in sorted(record.items())]
    unchanged = [r for r in live if record.get(r.rank) == (r.uid, r.restarts)]
    if size > 1 and unchanged and len(unchanged) < len(record):  # some ranks restarted, these did not
        return [r.pod for r in unchanged], old
    if sorted(r.rank for r in live) != list(range(size)):
        return [], old
    return [], [{"rank": r.rank, "podUID": r.uid, "restarts": r.restarts} for r in live]


def group_entry(group: int, workload: str, ranks: list[RankPod], size: int, gpus_per_pod: int,
                started_with: list[dict[str, Any]] | None) -> dict[str, Any]:
    """``status.groups[]`` for one group: its ranks as they run, ready when all ``size`` of them are."""
    live = [r for r in ranks if not r.terminating]
    entry: dict[str, Any] = {"group": group, "workload": workload,
                             "ready": len(live) == size and all(r.ready for r in live),
                             "ranks": [r.entry(gpus_per_pod) for r in live]}
    if started_with:
        entry["startedWith"] = started_with
    return entry
