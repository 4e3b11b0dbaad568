"""A rollout's deadline (``spec.rollout.progressDeadlineSeconds``): when a group on a new template halts it.

Engine groups roll one at a time (:mod:`.reconcile`): while one group is on its new template and not Ready, no
other group's template is replaced. A new version that never becomes Ready (an image that crash-loops, a
model the engines refuse, a layout no node fits) would so wait for ever, silently. With a deadline, as a
Deployment's ``progressDeadlineSeconds``:

- the operator stamps a workload with the time it gave it a new template (:data:`ANNOTATION`);
- a group still not Ready that long after is *halted*: the status says ``Progressing=False``, reason
  ``ProgressDeadlineExceeded``, with the pods' own reason (the container's last termination message, its
  waiting reason, or the scheduler's), and a ``RolloutHalted`` Event is posted;
- no other group is touched meanwhile (they keep serving on the old template), and reverting the spec gives
  the halted group (first) and every other moved group their old template back, one at a time.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from . import crd
from .scheduling import unschedulable

#: When the operator last gave the workload a new pod template (RFC 3339, UTC).
ANNOTATION = f"{crd.GROUP}/template-since"


def _parse(stamp: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None


def stamp(patch: dict[str, Any], now: datetime.datetime) -> None:
    """Mark ``patch`` (a workload's merge patch that replaces its template) with the time of the change."""
    annotations = patch.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[ANNOTATION] = now.strftime("%Y-%m-%dT%H:%M:%SZ")


def waited(live: dict[str, Any], now: datetime.datetime) -> float | None:
    """Seconds since ``live`` got its template from the operator (None: never stamped, or unreadable)."""
    since = _parse(((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION, ""))
    return None if since is None else (now - since).total_seconds()


def pod_reason(pods: list[dict[str, Any]]) -> str:
    """Why a group's pods are not Ready, in their own words: a container's last termination message or reason (an
    engine that refused its model exits saying why), its waiting reason (CrashLoopBackOff, ImagePullBackOff), or
    the scheduler's (a layout no node fits); "" when the pods say nothing."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            last = (container.get("lastState") or {}).get("terminated") or {}
            waiting = (container.get("state") or {}).get("waiting") or {}
            said = last.get("message") or waiting.get("message") or last.get("reason") or waiting.get("reason")
            if said and not container.get("ready"):
                return f"pod {pod['metadata']['name']} container {container.get('name')}: {str(said).strip()}"
    return unschedulable(pods)


@dataclass(frozen=True)
class Halted:
    """A group whose new template missed the deadline."""

    workload: str
    waited_s: float
    deadline_s: int

    def message(self, reason: str) -> str:
        because = f": {reason}" if reason else ""
        return (f"{self.workload} is not Ready {self.waited_s:.0f}s after its new template (deadline "
                f"{self.deadline_s}s){because}; the rollout is halted, the other groups keep their template "
                "(revert the spec to roll the moved groups back)")
