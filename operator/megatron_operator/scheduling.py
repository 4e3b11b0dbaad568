"""Why engine pods wait: the scheduler's own words, for the resource's ``EnginesReady`` condition.

A layout that fits no node (more GPUs per pod than any node offers, a node selector nothing matches) leaves its
engine pods Pending for good. The StatefulSet's status only says that fewer replicas are ready; the reason is on the
pods, in the ``PodScheduled`` condition the scheduler writes (``Unschedulable``, "0/3 nodes are available: 3
Insufficient nvidia.com/gpu."). The operator copies it into the resource's status so that ``kubectl get mi -o
yaml`` (and ``kubectl describe``) say why, without the user hunting for the pods.
"""

from __future__ import annotations

from typing import Any

#: At most this many pods are named in the message (a large group says "and N more").
NAMED = 3


def unschedulable(pods: list[dict[str, Any]]) -> str:
    """One line naming the pods the scheduler could not place and its reason ("" when every pod is placed or
    still waiting for its first try)."""
    stuck: list[tuple[str, str]] = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                stuck.append((pod["metadata"]["name"], str(cond.get("message") or "no reason given").strip()))
    if not stuck:
        return ""
    stuck.sort()
    named = ", ".join(name for name, _ in stuck[:NAMED])
    more = f" and {len(stuck) - NAMED} more" if len(stuck) > NAMED else ""
    noun = "pod" if len(stuck) == 1 else "pods"
    return f"{noun} {named}{more} cannot be scheduled: {stuck[0][1]}"
