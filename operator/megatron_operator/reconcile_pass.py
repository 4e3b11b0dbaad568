"""One reconcile pass over a MegatronInference: by level, not by edge, and without kopf.

The pass reads the resource, the coordinator and the children, acts, and returns what the handler
writes (the status keys that changed) and posts (events); :mod:`.handlers` is the only kopf code.
One pass:

1. validate the spec (``SpecValid=False`` and nothing else is touched when it is invalid);
2. read the coordinator's state over the project's client (token from the Secret);
3. ``Shutdown``: STOP first (:mod:`.lifecycle_walk`), and only once acknowledged scale engine
   StatefulSets to zero;
4. serve the spec's weights (:mod:`.refit_policy`);
5. reconcile the children (:mod:`.reconcile`): a gang (``spec.engine.parallelism``) is a
   LeaderWorkerSet where the API server serves them, else a StatefulSet whose other pods the pass
   deletes when one rank restarted (:mod:`.gang`);
6. other lifecycles: walk the coordinator to the desired state one acknowledged verb at a time;
7. compute the status (:mod:`.status`) and an event for every phase transition.

Per resource, the passes share a :class:`ResourceState`: a lock (one pass at a time), the open
coordinator link and the ``status.model`` this process wrote last.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import gang, kv_node, lifecycle, names, render, status
from . import leader_worker_set as lws
from .config import OperatorConfig
from .coordinator_link import CoordinatorRejected, CoordinatorUnavailable, LinkCache
from .kube import Kube
from .lifecycle_walk import walk
from .reconcile import Event, Reconciler, group_ready
from .refit_policy import recorded_model, sync_weights
from .rollout_deadline import pod_reason
from .scheduling import unschedulable
from .spec import InferenceSpec, SpecError, parse

logger = logging.getLogger("megatron_operator")


@dataclass
class ResourceState:
    """What the passes over one resource share (in this process)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    links: LinkCache = field(default_factory=LinkCache)
    model: dict[str, Any] | None = None  # the status.model written last (kopf applies it after the pass)
    api_error: str | None = None  # the Kubernetes API's refusal posted last as an Event (None: the last pass went)


@dataclass
class PassResult:
    """What the handler writes and posts."""

    status: dict[str, Any]  # the status keys that changed (empty: write nothing)
    events: list[Event] = field(default_factory=list)


async def run_pass(resource: Mapping[str, Any], state: ResourceState, kube: Kube, config: OperatorConfig,
                   log: logging.Logger | logging.LoggerAdapter = logger) -> PassResult:
    """One pass over ``resource`` (its apiVersion, kind, metadata, spec and status), one at a time."""
    async with state.lock:
        return await _pass(resource, state, kube, config, log)


async def _pass(resource: Mapping[str, Any], state: ResourceState, kube: Kube, config: OperatorConfig,
                log: logging.Logger | logging.LoggerAdapter) -> PassResult:
    """One reconcile pass of one resource: parse, reach the coordinator, stop, refit, apply the children,
    walk the lifecycle, observe and compute the status.

    Long: the steps run in this order and share the pass's observations; each one's work is a call into its
    own module (lifecycle, weights, render, children, status).
    """
    meta = resource["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid")
    generation = meta.get("generation")
    previous = dict(resource.get("status") or {})
    events: list[Event] = []
    try:
        spec = parse({"apiVersion": resource.get("apiVersion"), "kind": resource.get("kind"),
                      "metadata": dict(meta), "spec": dict(resource.get("spec") or {})})
    except SpecError as exc:
        new = status.compute(previous, status.Observation(generation=generation, spec_error="; ".join(exc.reasons)))
        return PassResult(status.changes(previous, new), status_events(previous, new))

    obs = status.Observation(generation=generation, desired_lifecycle=spec.lifecycle,
                             endpoint=names.endpoint(name, namespace, spec.server_port),
                             selector=names.engine_pod_selector(name), kv_events=kv_node.events_status(spec))
    token = await existing_token(kube, name, namespace)
    address = config.coordinator_address(name, namespace)
    coordinator_state: str | None = None
    coordinator_status: dict[str, Any] | None = None
    link = None
    try:
        link = await state.links.get(address, token or render.derive_token(config.token_key, namespace, name, uid),
                                     config.connect_timeout)
        coordinator_status = await link.status(config.connect_timeout)
        coordinator_state = str(coordinator_status.get("state", "")).upper() or None
        obs.coordinator_ok = True
        obs.coordinator_message = f"coordinator {coordinator_state} at {address}"
    except CoordinatorUnavailable as exc:
        await state.links.drop()
        link = None
        obs.coordinator_message = str(exc)
        obs.lifecycle_message = f"waiting for the coordinator: {exc}"

    target = lifecycle.target_state(spec.lifecycle)

    async def walk_to_target() -> None:
        nonlocal link, coordinator_state
        assert link is not None
        done = await walk(link, coordinator_state, target, command_timeout=config.command_timeout,
                          drain_timeout=float(spec.drain_timeout_seconds), pause_mode=spec.pause_mode,
                          keep_kv=spec.suspend_keep_kv)
        events.extend(done.events)
        coordinator_state = done.state
        if done.message:
            obs.lifecycle_message = done.message
        obs.lifecycle_error = obs.lifecycle_error or done.error
        if done.link_lost:
            await state.links.drop()
            link = None

    # Shutdown: STOP (engines drain and exit) before the StatefulSets scale to zero.
    if link is not None and target == lifecycle.STOPPED and coordinator_state != lifecycle.STOPPED:
        await walk_to_target()
    engines_stopped = target == lifecycle.STOPPED and (link is None or coordinator_state == lifecycle.STOPPED)

    # New weights (spec.model.path / revision): refit in place, or roll the pods when that cannot work.
    weights = await sync_weights(link, spec, recorded_model(previous, spec, state.model), coordinator_state,
                                 coordinator_status, target, config.command_timeout)
    events.extend(weights.events)
    if weights.link_lost:
        await state.links.drop()
        link = None
    obs.model = state.model = weights.model
    rendered = dataclasses.replace(spec, model_path=weights.model["templatePath"],
                                   model_hub=weights.model.get("templateHub"))
    leader_worker_set = spec.gang and config.leader_worker_set and await kube.serves(lws.API_VERSION, lws.PLURAL)
    desired = render.render_spec(rendered, config, token=token, engines_stopped=engines_stopped,
                                 leader_worker_set=leader_worker_set)
    children = await Reconciler(kube).children(desired, name=name, namespace=namespace, uid=uid,
                                               leader_worker_set=leader_worker_set,
                                               progress_deadline_seconds=spec.progress_deadline_seconds)
    events.extend(children.events)
    events.extend(("Warning", "Conflict", f"{label} exists and is controlled by another owner; left alone")
                  for label in children.conflicts)
    if children.deferred:
        log.info("engine groups waiting for their turn to roll: %s", ", ".join(children.deferred))

    # Other lifecycles: once the engines exist (or are scaling up again), walk the coordinator.
    if link is not None and target != lifecycle.STOPPED and coordinator_state != target:
        await walk_to_target()
        if link is not None:
            try:
                coordinator_status = await link.status(config.connect_timeout)
            except CoordinatorUnavailable:
                pass

    if obs.coordinator_ok and coordinator_state:
        obs.observed_lifecycle = lifecycle.lifecycle_of(coordinator_state)
        if not obs.lifecycle_message:
            obs.lifecycle_message = f"coordinator {coordinator_state}" + (
                " as desired" if coordinator_state == target else f", desired {target}")

    pods = spec.pods_per_group
    obs.engines_desired = 0 if target == lifecycle.STOPPED else spec.data
    workload = lws.KIND if leader_worker_set else "StatefulSet"
    workloads = {k[1]: v for k, v in children.live.items() if k[0] == workload}
    ready = [group_ready(workloads.get(names.engine_name(name, g)), pods) for g in range(spec.data)]
    obs.engines_ready = sum(ready)
    if spec.prefill_replicas:
        obs.roles = [{"group": g, "role": spec.role(g), "kvRole": spec.kv_role(g), "ready": ready[g]}
                     for g in range(spec.data)]
    if spec.gang:
        obs.groups = await observe_gangs(kube, spec, workload, previous, events)
    if obs.engines_ready < obs.engines_desired:
        obs.engines_unschedulable = unschedulable(
            await kube.list("v1", "Pod", namespace, names.engine_pod_selector(name)))
    obs.rolling = ", ".join(children.rolling)
    if children.halted:  # spec.rollout.progressDeadlineSeconds: the first group past it, in its pods' words
        halted = children.halted[0]
        pods = await kube.list("v1", "Pod", namespace, names.engine_pod_selector(name))
        obs.rollout_halted = halted.message(pod_reason([p for p in pods if p["metadata"]["name"].startswith(
            f"{halted.workload}-")]))
    connected = connected_groups(coordinator_status) if obs.coordinator_ok else set()
    obs.engines_connected = len({g for g in connected if 0 <= g < spec.data})
    new = status.compute(previous, obs)
    return PassResult(status.changes(previous, new), events + status_events(previous, new))


async def observe_gangs(kube: Kube, spec: InferenceSpec, workload: str, previous: dict[str, Any],
                        events: list[Event]) -> list[dict[str, Any]]:
    """``status.groups`` from the engine pods; a StatefulSet group some of whose ranks restarted loses its
    other pods too (:func:`.gang.plan`), so that the whole group starts again."""
    pods = await kube.list("v1", "Pod", spec.namespace, names.engine_pod_selector(spec.name))
    by_group = gang.group_pods(pods, spec.name, spec.data, workload)
    recorded = {int(g["group"]): g for g in previous.get("groups") or [] if isinstance(g, dict) and "group" in g}
    size = spec.pods_per_group
    groups = []
    for group, ranks in by_group.items():
        started_with = None
        if workload == "StatefulSet":
            doomed, started_with = gang.plan(recorded.get(group), ranks, size)
            for pod in doomed:
                await kube.delete("v1", "Pod", spec.namespace, pod)
            if doomed:
                events.append(("Warning", "GroupRestart", f"engine group {group}: a rank restarted; deleted the "
                                                          f"group's other pods ({', '.join(doomed)}) to restart it "
                                                          "whole"))
        groups.append(gang.group_entry(group, workload, ranks, size, spec.gpus_per_engine_pod, started_with))
    return groups


async def stop_fleet(resource: Mapping[str, Any], state: ResourceState, kube: Kube, config: OperatorConfig,
                     log: logging.Logger | logging.LoggerAdapter = logger) -> list[Event]:
    """The finalizer's work: STOP the fleet gracefully, bounded by ``drainTimeoutSeconds``; the link is closed."""
    meta = resource["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    drain = int((resource.get("spec") or {}).get("drainTimeoutSeconds", 60))
    async with state.lock:
        token = await existing_token(kube, name, namespace)
        address = config.coordinator_address(name, namespace)
        try:
            link = await state.links.get(address, token or render.derive_token(config.token_key, namespace, name,
                                                                               meta.get("uid")),
                                         config.connect_timeout)
            ack = await link.command("stop", float(max(drain, 1)) + 5.0, drain_timeout=float(drain))
            return [("Normal", "Stopped", f"STOP acknowledged before deletion: {ack.get('state', 'STOPPED')}")]
        except (CoordinatorUnavailable, CoordinatorRejected) as exc:
            log.warning("could not stop the fleet gracefully (%s); children are deleted anyway", exc)
            return [("Warning", "StopFailed", f"could not stop the fleet gracefully: {exc}")]
        finally:
            await state.links.drop()


async def existing_token(kube: Kube, name: str, namespace: str) -> str | None:
    """The coordinator token in the resource's Secret, if there is one."""
    secret = await kube.get("v1", "Secret", namespace, names.secret_name(name))
    encoded = ((secret or {}).get("data") or {}).get(render.TOKEN_KEY)
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def connected_groups(coordinator_status: dict[str, Any] | None) -> set[int]:
    """The engine groups the coordinator lists."""
    groups: set[int] = set()
    for engine in (coordinator_status or {}).get("engines") or []:
        try:
            groups.add(int(engine.get("group")))
        except (TypeError, ValueError):
            continue
    return groups


def status_events(previous: dict[str, Any], new: dict[str, Any]) -> list[Event]:
    """Events for a status change: a phase transition, a coordinator that stopped answering."""
    events: list[Event] = []
    old_phase, new_phase = previous.get("phase"), new.get("phase")
    if old_phase != new_phase:
        kind = "Warning" if new_phase in ("Failed", "Degraded") else "Normal"
        reason = "InvalidSpec" if new_phase == "Failed" else "Phase"
        message = f"phase {old_phase or 'None'} -> {new_phase}"
        if new_phase == "Failed":
            spec_valid = next((c for c in new.get("conditions", []) if c["type"] == "SpecValid"), {})
            message = f"invalid spec: {spec_valid.get('message', '')}"
        events.append((kind, reason, message))
    old_cond = {c.get("type"): c.get("status") for c in previous.get("conditions") or []}
    for cond in new.get("conditions", []):
        if cond["type"] == "CoordinatorReady" and cond["status"] == "False" \
                and old_cond.get("CoordinatorReady") == "True":
            events.append(("Warning", "CoordinatorUnreachable", cond.get("message", "")))
        if cond["type"] == "Progressing" and cond["status"] == "False" and old_cond.get("Progressing") != "False":
            events.append(("Warning", "RolloutHalted", cond.get("message", "")))
    return events
