"""Child reconciliation: make the live children match what :mod:`render` says, minimally.

- A missing child is created; an existing one is patched only where it differs from the
  rendered object (server-side defaults and extra fields are left alone), so a second pass over
  an unchanged resource makes no API writes at all.
- An existing object of the same name that no controller owns is adopted (the patch adds our
  labels and ownerReference); one owned by another controller is left alone and reported.
- Engine groups roll one at a time: the pod template of a group is replaced only while no
  other group is still coming up on a new template. Engines drain on SIGTERM (preStop and
  terminationGracePeriodSeconds), so replacing a group's pods drains it first.
- Engine groups at or above ``data`` (StatefulSet or LeaderWorkerSet, and headless Service) are
  deleted, highest first; their engines drain the same way. So are a group's objects of the other
  workload kind (a gang moving between StatefulSet and LeaderWorkerSet when that CRD comes or goes).
- A patch the API server refuses as invalid (an immutable field changed) deletes the object,
  and the next pass creates it again. A StatefulSet is deleted with its pods orphaned: the new one
  (same name, same selector) adopts them, so their engines serve on through the recreate and its
  requests in flight are not touched; a template that changed with it then rolls as any other.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field
from typing import Any

from . import leader_worker_set as lws
from . import disruption, kv_node, names, quantities, render, templates
from .kube import Kube, KubeError
from .rollout_deadline import Halted, stamp, waited

Event = tuple[str, str, str]  # (type, reason, message)

#: engine group workloads -> (apiVersion, the key of their spec that holds the pod template)
WORKLOADS = {"StatefulSet": ("apps/v1", "template"), lws.KIND: (lws.API_VERSION, "leaderWorkerTemplate")}


def _scalar_equal(want: Any, have: Any) -> bool:
    if want == have:
        return True
    # quantities and ports come back as strings or numbers ("8" vs 8)
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)) \
            and not isinstance(want, bool) and not isinstance(have, bool):
        return str(want) == str(have)
    return False


def contains(want: Any, have: Any) -> bool:
    """Whether ``have`` (live) already holds everything ``want`` (rendered) says; quantities by value, as the API
    server stores them in another spelling (:mod:`.quantities`)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return False
        return all(key in have and _holds(key, value, have[key]) for key, value in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(contains(w, h) for w, h in zip(want, have))
    return _scalar_equal(want, have)


def _holds(key: str, want: Any, have: Any) -> bool:
    if key in quantities.QUANTITY_MAPS and quantities.map_contains(want, have):
        return True
    if key in quantities.QUANTITY_FIELDS and quantities.equal(want, have):
        return True
    return contains(want, have)


def diff(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that makes ``have`` contain ``want`` (empty when it already does).

    Lists are replaced whole (merge-patch semantics), maps are merged key by key.
    """
    patch: dict[str, Any] = {}
    for key, value in want.items():
        if key in have and contains(value, have[key]):
            continue
        if isinstance(value, dict) and isinstance(have.get(key), dict):
            patch[key] = diff(value, have[key])
        else:
            patch[key] = value
    return patch


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def group_of(obj: dict[str, Any]) -> int | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(names.GROUP_LABEL)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def settled(sts: dict[str, Any]) -> bool:
    """A StatefulSet (or LeaderWorkerSet) whose controller has caught up and whose replicas are all ready."""
    spec = sts.get("spec") or {}
    status = sts.get("status") or {}
    replicas = int(spec.get("replicas", 1))
    generation = (sts.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and (observed is None or int(observed) < int(generation)):
        return False
    # A count of 0 is left out of the object (omitempty): a controller that has just seen a new template writes no
    # updatedReplicas while the old pod is still counted ready, and that group is rolling, not settled.
    return int(status.get("readyReplicas") or 0) >= replicas and int(status.get("updatedReplicas") or 0) >= replicas


def group_ready(sts: dict[str, Any] | None, pods: int) -> bool:
    """Engine group readiness: the StatefulSet runs all its pods ready, on its current template (a
    LeaderWorkerSet its one replica: the leader and every worker)."""
    if sts is None or pods <= 0:
        return False
    if int((sts.get("spec") or {}).get("replicas", 0)) < (1 if sts.get("kind") == lws.KIND else pods):
        return False
    return settled(sts)


def on_template(obj: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether the live workload runs the rendered workload ``obj``'s pod template: it holds all of it, and the
    template it was last given (its recorded hash, where it has one) is this one (:mod:`.templates`)."""
    key = WORKLOADS[obj["kind"]][1]
    recorded = templates.recorded_hash(live)
    return contains(obj["spec"][key], (live.get("spec") or {}).get(key)) and \
        recorded in (None, templates.template_hash(obj["spec"][key]))


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@dataclass
class ChildrenResult:
    live: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    writes: int = 0
    events: list[Event] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # groups waiting for their turn to roll
    rolling: list[str] = field(default_factory=list)  # groups on a new template, not Ready yet
    halted: list[Halted] = field(default_factory=list)  # those of them past spec.rollout.progressDeadlineSeconds


class Reconciler:
    def __init__(self, kube: Kube):
        self.kube = kube

    async def _get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        meta = obj["metadata"]
        return await self.kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])

    async def children(self, desired: list[dict[str, Any]], *, name: str, namespace: str,
                       uid: str | None, leader_worker_set: bool = False, progress_deadline_seconds: int | None = None,
                       now: datetime.datetime | None = None) -> ChildrenResult:
        """Create or patch ``desired``; delete engine objects it no longer holds (``leader_worker_set``: the
        cluster serves LeaderWorkerSets, which are looked for too). A group on a new template and not Ready
        ``progress_deadline_seconds`` after it got it is reported in ``halted`` (:mod:`.rollout_deadline`)."""
        result = ChildrenResult()
        now = now or datetime.datetime.now(datetime.timezone.utc)
        # one at a time: no extra tasks (kopf re-raises from tasks still running when it stops)
        live_by_key = {_key(obj): await self._get(obj) for obj in desired}

        # Which engine groups are already on their new template but not up yet: while one is,
        # no other group's template is replaced. Else one group takes its new template this pass: a group that is
        # not Ready first (a halted rollout's, when the spec is reverted), then the lowest.
        rolling: set[str] = set()
        waiting: list[tuple[bool, int, str]] = []  # (Ready, group, name) of the groups whose template differs
        for obj in desired:
            live = live_by_key[_key(obj)]
            if obj["kind"] in WORKLOADS and live is not None and controller_uid(live) in (None, uid):
                if not on_template(obj, live):
                    waiting.append((settled(live), group_of(obj) or 0, obj["metadata"]["name"]))
                elif int(obj["spec"]["replicas"]) > 0 and not settled(live):
                    rolling.add(obj["metadata"]["name"])
                    seconds = waited(live, now)
                    if progress_deadline_seconds is not None and seconds is not None \
                            and seconds > progress_deadline_seconds:
                        result.halted.append(Halted(obj["metadata"]["name"], seconds, progress_deadline_seconds))
        turn = None if rolling or not waiting else min(waiting)[2]

        for obj in desired:
            key = _key(obj)
            live = live_by_key[key]
            label = f"{obj['kind']} {obj['metadata']['name']}"
            if live is None:
                created = await self._create(obj, result)
                result.live[key] = created if created is not None else obj
                continue
            owner = controller_uid(live)
            if owner is not None and uid is not None and owner != uid:
                result.conflicts.append(label)
                result.live[key] = live
                continue
            patch = diff(obj, live)
            if obj["kind"] == "Secret" and render.TOKEN_KEY in (live.get("data") or {}):
                patch.pop("data", None)  # the token of an existing Secret is never rotated
            if obj["kind"] in WORKLOADS and not on_template(obj, live):
                template_key = WORKLOADS[obj["kind"]][1]
                patch.setdefault("spec", {}).pop(template_key, None)
                if obj["metadata"]["name"] != turn:
                    result.deferred.append(obj["metadata"]["name"])
                else:  # exactly the rendered template (a key the spec dropped goes too), stamped
                    patch["spec"][template_key] = templates.exact(obj["spec"][template_key],
                                                                  (live.get("spec") or {}).get(template_key))
                    templates.mark(patch, obj["spec"][template_key])
                    rolling.add(obj["metadata"]["name"])
                    stamp(patch, now)
                if not patch["spec"]:
                    patch.pop("spec")
            if not patch:
                result.live[key] = live
                continue
            result.live[key] = await self._patch(obj, patch, live, result)

        result.rolling = sorted(rolling)
        kinds = [("apps/v1", "StatefulSet"), ("v1", "Service")]
        if leader_worker_set:
            kinds.insert(1, (lws.API_VERSION, lws.KIND))
        await self._delete_extra_groups(name, namespace, uid, kinds, {_key(o) for o in desired}, result)
        await self._delete_dropped(name, namespace, uid, {_key(o) for o in desired}, result)
        return result

    async def _delete_dropped(self, name: str, namespace: str, uid: str | None, wanted: set[tuple[str, str]],
                              result: ChildrenResult) -> None:
        """Delete the optional children the spec no longer asks for (the KV events Service without kvEvents, the
        disruption budgets without spec.disruptionBudget)."""
        optional = [("v1", "Service", kv_node.kv_events_service_name(name)),
                    *(("policy/v1", "PodDisruptionBudget", budget) for budget in disruption.budget_names(name))]
        for api_version, kind, item_name in optional:
            if (kind, item_name) in wanted:
                continue
            live = await self.kube.get(api_version, kind, namespace, item_name)
            if live is None or controller_uid(live) not in (None, uid):
                continue
            await self.kube.delete(api_version, kind, namespace, item_name)
            result.writes += 1
            result.events.append(("Normal", "Deleted", f"Deleted {kind} {item_name} (no longer in the spec)"))

    async def _create(self, obj: dict[str, Any], result: ChildrenResult) -> dict[str, Any] | None:
        label = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in WORKLOADS:  # the template it starts with, for the next change to compare with
            obj = copy.deepcopy(obj)
            templates.mark(obj, obj["spec"][WORKLOADS[obj["kind"]][1]])
        try:
            created = await self.kube.create(obj)
        except KubeError as exc:
            if exc.status == 409:  # created meanwhile (by us or a stale watch): next pass patches
                return None
            raise
        result.writes += 1
        result.events.append(("Normal", "Created", f"Created {label}"))
        return created

    async def _patch(self, obj: dict[str, Any], patch: dict[str, Any], live: dict[str, Any],
                     result: ChildrenResult) -> dict[str, Any]:
        meta = obj["metadata"]
        label = f"{obj['kind']} {meta['name']}"
        try:
            patched = await self.kube.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], patch)
        except KubeError as exc:
            if exc.status == 422:  # an immutable field differs: replace the object
                keep = obj["kind"] == "StatefulSet"  # its pods, for the new one to adopt
                await self.kube.delete(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"],
                                       propagation="Orphan" if keep else "Background")
                result.writes += 1
                kept = " (its pods kept for the new one)" if keep else ""
                result.events.append(("Warning", "Recreating", f"Deleted {label} to recreate it{kept}: {exc}"))
                return live
            raise
        result.writes += 1
        adopted = controller_uid(live) is None and "ownerReferences" in patch.get("metadata", {})
        what = "Adopted" if adopted else "Updated"
        parts: list[str] = []
        for top, value in patch.items():
            parts += [f"{top}.{sub}" for sub in value] if isinstance(value, dict) else [top]
        result.events.append(("Normal", what, f"{what} {label} ({', '.join(sorted(parts))})"))
        return patched or live

    async def _delete_extra_groups(self, name: str, namespace: str, uid: str | None,
                                   kinds: list[tuple[str, str]], wanted: set[tuple[str, str]],
                                   result: ChildrenResult) -> None:
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=engine"
        for api_version, kind in kinds:
            items = await self.kube.list(api_version, kind, namespace, selector)
            extra = []
            for item in items:
                item_name = item["metadata"]["name"]
                group = group_of(item)
                if (kind, item_name) in wanted or group is None:
                    continue
                if controller_uid(item) not in (None, uid) or item_name != names.engine_name(name, group):
                    continue
                extra.append((group, item_name))
            for group, item_name in sorted(extra, reverse=True):
                await self.kube.delete(api_version, kind, namespace, item_name)
                result.writes += 1
                result.events.append(("Normal", "Deleted", f"Deleted {kind} {item_name} (engine group {group})"))
