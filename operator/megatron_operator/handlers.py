"""kopf handlers of the megatron-serve operator (``megatron-serve operator`` loads this module).

Every handler funnels into :func:`reconcile`, which works by level, not by edge: create,
update and resume handlers run it at once, and a timer runs it every
``MEGATRON_OPERATOR_RECONCILE_INTERVAL`` seconds, so restarts of the operator or of a
coordinator converge. One pass:

1. validate the spec (``SpecValid=False`` and nothing else is touched when it is invalid);
2. read the coordinator's state over the project's client (token from the Secret);
3. ``Shutdown``: STOP first, and only once acknowledged scale engine StatefulSets to zero;
4. reconcile the children (:mod:`megatron_operator.reconcile`);
5. other lifecycles: walk the coordinator to the desired state one acknowledged verb at a
   time (Running -> Suspended = PAUSE, SUSPEND; Suspended -> Running = RESUME, UNPAUSE);
6. write the status keys that changed, and post a Kubernetes Event for every transition.

Deleting a resource runs a finalizer that STOPs the fleet, bounded by ``drainTimeoutSeconds``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from typing import Any

import kopf

from . import coordinator_link, crd, lifecycle, render, status
from .config import OperatorConfig
from .coordinator_link import CoordinatorRejected, CoordinatorUnavailable, RefitFailed
from .kube import Kube, KubeError
from .reconcile import Reconciler, group_ready
from .spec import SpecError, parse

logger = logging.getLogger("megatron_operator")

CONFIG = OperatorConfig.from_env()
FINALIZER = f"{crd.GROUP}/finalizer"

_state: dict[str, Any] = {"kube": None}


def kube() -> Kube:
    if _state["kube"] is None:
        _state["kube"] = Kube()
    return _state["kube"]


def set_kube(client: Kube | None) -> None:
    """Use another API client (tests); ``None`` goes back to the default credentials."""
    _state["kube"] = client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    settings.posting.reporting_component = "megatron-operator"
    settings.scanning.disabled = not CONFIG.scanning
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    # A deletion waits for a running timer pass to end: look again after a second, not a minute.
    settings.background.cancellation_polling = 1.0


@kopf.on.probe(id="ready")
def probe_ready(**_: Any) -> bool:
    return True


# --------------------------------------------------------------------------- helpers

def _lock(memo: Any) -> asyncio.Lock:
    lock = getattr(memo, "megatron_lock", None)
    if lock is None:
        lock = memo.megatron_lock = asyncio.Lock()
    return lock


async def _existing_token(name: str, namespace: str) -> str | None:
    secret = await kube().get("v1", "Secret", namespace, render.secret_name(name))
    encoded = ((secret or {}).get("data") or {}).get(render.TOKEN_KEY)
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded).decode()
    except (ValueError, UnicodeDecodeError):
        return None


async def _link(memo: Any, address: str, token: str | None) -> coordinator_link.CoordinatorLink:
    cached = getattr(memo, "megatron_link", None)
    if cached is not None and getattr(memo, "megatron_link_key", None) == (address, token):
        return cached
    await _drop_link(memo)
    link = await coordinator_link.open_link(address, token, CONFIG.connect_timeout)
    memo.megatron_link = link
    memo.megatron_link_key = (address, token)
    return link


async def _drop_link(memo: Any) -> None:
    link = getattr(memo, "megatron_link", None)
    memo.megatron_link = None
    if link is not None:
        try:
            await link.close()
        except Exception:  # best effort
            pass


def _connected_groups(coordinator_status: dict[str, Any] | None) -> set[int]:
    groups: set[int] = set()
    for engine in (coordinator_status or {}).get("engines") or []:
        try:
            groups.add(int(engine.get("group")))
        except (TypeError, ValueError):
            continue
    return groups


def _event(body: Any, kind: str, reason: str, message: str) -> None:
    try:
        kopf.event(body, type=kind, reason=reason, message=message)
    except Exception as exc:  # events are best effort
        logger.debug("could not post event %s: %s", reason, exc)


# --------------------------------------------------------------------------- the pass

async def reconcile(body: Any, meta: Any, memo: Any, patch: Any, log: logging.Logger | logging.LoggerAdapter) -> None:
    async with _lock(memo):
        await _reconcile(body, meta, memo, patch, log)


async def _reconcile(body: Any, meta: Any, memo: Any, patch: Any, log: Any) -> None:
    name, namespace, uid = meta["name"], meta["namespace"], meta.get("uid")
    generation = meta.get("generation")
    previous = dict(body.get("status") or {})
    resource = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                "metadata": dict(meta), "spec": dict(body.get("spec") or {})}
    try:
        spec = parse(resource)
    except SpecError as exc:
        message = "; ".join(exc.reasons)
        new = status.compute(previous, status.Observation(generation=generation, spec_error=message))
        _write_status(body, patch, previous, new)
        return

    obs = status.Observation(generation=generation, desired_lifecycle=spec.lifecycle,
                             endpoint=render.endpoint(name, namespace, spec.server_port),
                             selector=render.engine_pod_selector(name))
    token = await _existing_token(name, namespace)
    address = CONFIG.coordinator_address(name, namespace)
    coordinator_state: str | None = None
    coordinator_status: dict[str, Any] | None = None
    link = None
    try:
        link = await _link(memo, address, token or render.derive_token(CONFIG.token_key, namespace, name, uid))
        coordinator_status = await link.status(CONFIG.connect_timeout)
        coordinator_state = str(coordinator_status.get("state", "")).upper() or None
        obs.coordinator_ok = True
        obs.coordinator_message = f"coordinator {coordinator_state} at {address}"
    except CoordinatorUnavailable as exc:
        await _drop_link(memo)
        link = None
        obs.coordinator_message = str(exc)
        obs.lifecycle_message = f"waiting for the coordinator: {exc}"

    target = lifecycle.target_state(spec.lifecycle)
    # Shutdown: STOP (engines drain and exit) before the StatefulSets scale to zero.
    if link is not None and target == lifecycle.STOPPED and coordinator_state != lifecycle.STOPPED:
        coordinator_state = await _walk(body, memo, link, coordinator_state, target, spec, obs)
        link = getattr(memo, "megatron_link", None)
    engines_stopped = target == lifecycle.STOPPED and (link is None or coordinator_state == lifecycle.STOPPED)

    # New weights (spec.model.path / revision): refit in place, or roll the pods when that cannot work.
    obs.model = await _sync_weights(body, memo, link, spec, _model_status(previous, spec, memo), coordinator_state,
                                    coordinator_status, target)
    memo.megatron_model = obs.model
    link = getattr(memo, "megatron_link", None) if link is not None else None
    rendered = dataclasses.replace(spec, model_path=obs.model["templatePath"])
    desired = render.render_spec(rendered, CONFIG, token=token, engines_stopped=engines_stopped)
    result = await Reconciler(kube()).children(desired, name=name, namespace=namespace, uid=uid, data=spec.data)
    for kind, reason, message in result.events:
        _event(body, kind, reason, message)
    for label in result.conflicts:
        _event(body, "Warning", "Conflict", f"{label} exists and is controlled by another owner; left alone")
    if result.deferred:
        log.info("engine groups waiting for their turn to roll: %s", ", ".join(result.deferred))

    # Other lifecycles: once the engines exist (or are scaling up again), walk the coordinator.
    if link is not None and target != lifecycle.STOPPED and coordinator_state != target:
        coordinator_state = await _walk(body, memo, link, coordinator_state, target, spec, obs)
        link = getattr(memo, "megatron_link", None)
        if link is not None:
            try:
                coordinator_status = await link.status(CONFIG.connect_timeout)
            except CoordinatorUnavailable:
                pass

    if obs.coordinator_ok and coordinator_state:
        obs.observed_lifecycle = lifecycle.lifecycle_of(coordinator_state)
        if not obs.lifecycle_message:
            obs.lifecycle_message = f"coordinator {coordinator_state}" + (
                " as desired" if coordinator_state == target else f", desired {target}")

    pods = spec.pods_per_group
    obs.engines_desired = 0 if target == lifecycle.STOPPED else spec.data
    statefulsets = {k[1]: v for k, v in result.live.items() if k[0] == "StatefulSet"}
    obs.engines_ready = sum(1 for g in range(spec.data)
                            if group_ready(statefulsets.get(render.engine_name(name, g)), pods))
    connected = _connected_groups(coordinator_status) if obs.coordinator_ok else set()
    obs.engines_connected = len({g for g in connected if 0 <= g < spec.data})
    new = status.compute(previous, obs)
    _write_status(body, patch, previous, new)


async def _walk(body: Any, memo: Any, link: Any, current: str | None, target: str, spec: Any,
                obs: status.Observation) -> str | None:
    """Send the verbs from ``current`` to ``target``, each acknowledged; returns the last state."""
    if current is None:
        return current
    try:
        verbs = lifecycle.plan(current, target)
    except ValueError as exc:
        obs.lifecycle_error = True
        obs.lifecycle_message = str(exc)
        return current
    for verb in verbs:
        if verb == "stop":
            timeout = CONFIG.command_timeout + spec.drain_timeout_seconds
            call = link.command(verb, timeout, drain_timeout=float(spec.drain_timeout_seconds))
        else:
            call = link.command(verb, CONFIG.command_timeout)
        try:
            ack = await call
        except CoordinatorRejected as exc:
            obs.lifecycle_error = True
            obs.lifecycle_message = str(exc)
            _event(body, "Warning", "LifecycleRejected", str(exc))
            return current
        except CoordinatorUnavailable as exc:
            await _drop_link(memo)
            obs.lifecycle_error = True
            obs.lifecycle_message = str(exc)
            _event(body, "Warning", "LifecycleTimeout", str(exc))
            return current
        state = str(ack.get("state") or lifecycle.next_state(current, verb)).upper()
        detail = ack.get("detail")
        message = f"{verb.upper()} acknowledged: {current} -> {state}"
        if detail:
            message += f" ({_short(detail)})"
        _event(body, "Normal", "Lifecycle", message)
        obs.lifecycle_message = message
        current = state
    return current


# --------------------------------------------------------------------------- weights

def _model_status(previous: dict[str, Any], spec: Any, memo: Any) -> dict[str, Any]:
    """``status.model`` as recorded; for a new resource, the spec's model as started (epoch 0).

    What this process recorded last wins over the body's status: kopf applies a handler's status
    patch after the handler returns, so the next pass may still see the older status, and a refit
    must not run twice.
    """
    model = dict(getattr(memo, "megatron_model", None) or previous.get("model") or {})
    if not model.get("templatePath"):
        model = _started_with(spec)
    return model


def _started_with(spec: Any) -> dict[str, Any]:
    """``status.model`` of pods (re)started from the spec's model: the template carries its path."""
    model: dict[str, Any] = {"path": spec.model_path, "epoch": 0, "templatePath": spec.model_path}
    if spec.model_revision is not None:
        model["revision"] = spec.model_revision
    return model


async def _sync_weights(body: Any, memo: Any, link: Any, spec: Any, model: dict[str, Any], state: str | None,
                        coordinator_status: dict[str, Any] | None, target: str) -> dict[str, Any]:
    """Serve the spec's weights; returns the new ``status.model``.

    The pod templates keep ``templatePath`` (so a refit never rolls a pod): engines that start
    later load it and, at registration, the coordinator's current weights. A changed
    ``spec.model.path``/``revision`` on a fleet that serves (coordinator reachable, an engine
    connected, not shutting down) is refitted in place: PAUSE (if running), REFIT, UNPAUSE. If an
    engine refuses the weights (another architecture), the fleet keeps the old ones and the
    template takes the new path instead: the usual drain-first rolling replacement. With nothing
    serving, the template takes the new path at once. By level: a coordinator whose epoch is
    behind ``status.model.epoch`` (it restarted along with its engines) is refitted again.
    """
    wanted = (spec.model_path, spec.model_revision)
    changed = (model.get("path"), model.get("revision")) != wanted
    reply = coordinator_status or {}
    fleet_epoch = reply.get("epoch")
    serving = (link is not None and target != lifecycle.STOPPED and state in (lifecycle.RUNNING, lifecycle.PAUSED,
                                                                             lifecycle.SUSPENDED)
               and bool(reply.get("engines")))
    epoch = int(model.get("epoch") or 0)
    if not changed:
        if serving and isinstance(fleet_epoch, int) and fleet_epoch < epoch:
            try:
                await _refit(memo, link, state, model["path"], epoch)
            except (CoordinatorRejected, CoordinatorUnavailable) as exc:
                _event(body, "Warning", "RefitFailed", f"could not restore the weights of epoch {epoch}: {exc}")
            else:
                _event(body, "Normal", "Refitted", f"the coordinator reported epoch {fleet_epoch}: weights of "
                       f"epoch {epoch} ({model['path']}) loaded again")
        return model
    if link is None:
        return model  # the coordinator is unreachable: decide once it answers
    if not serving:
        return _started_with(spec)
    epoch = max(epoch, fleet_epoch if isinstance(fleet_epoch, int) else 0) + 1
    try:
        ack = await _refit(memo, link, state, spec.model_path, epoch)
    except RefitFailed as exc:
        _event(body, "Warning", "RefitFailed", f"{exc}; replacing the engine pods instead (drain first)")
        return _started_with(spec)
    except (CoordinatorRejected, CoordinatorUnavailable) as exc:
        _event(body, "Warning", "RefitFailed", f"refit to {spec.model_path} not done, retrying: {exc}")
        return model
    new = {**_started_with(spec), "epoch": int((ack.get("detail") or {}).get("epoch", epoch)),
           "refittedAt": status.now_iso(), "templatePath": model["templatePath"]}
    engines = (ack.get("detail") or {}).get("engines") or {}
    slowest = max((float(f.get("total_s") or 0.0) for f in engines.values() if isinstance(f, dict)), default=0.0)
    revision = f" (revision {spec.model_revision})" if spec.model_revision else ""
    _event(body, "Normal", "Refitted", f"weights refitted in place from {spec.model_path}{revision}: epoch "
           f"{new['epoch']} on {len(engines)} engine group(s), slowest {slowest:.1f}s; no pod replaced")
    return new


async def _refit(memo: Any, link: Any, state: str | None, source: str, epoch: int) -> dict[str, Any]:
    """PAUSE (only if running), REFIT, and UNPAUSE again (also after a refused REFIT)."""
    timeout = CONFIG.command_timeout
    running = state == lifecycle.RUNNING
    try:
        if running:
            await link.command("pause", timeout)
        try:
            return await link.refit(source, epoch, timeout)
        finally:
            if running:
                await link.command("unpause", timeout)
    except CoordinatorUnavailable:
        await _drop_link(memo)  # the lifecycle walk of a later pass puts the state right
        raise


def _short(detail: Any, limit: int = 200) -> str:
    text = str(detail)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _write_status(body: Any, patch: Any, previous: dict[str, Any], new: dict[str, Any]) -> None:
    delta = status.changes(previous, new)
    if not delta:
        return
    patch.setdefault("status", {}).update(delta)
    old_phase, new_phase = previous.get("phase"), new.get("phase")
    if old_phase != new_phase:
        kind = "Warning" if new_phase in ("Failed", "Degraded") else "Normal"
        reason = "InvalidSpec" if new_phase == "Failed" else "Phase"
        message = f"phase {old_phase or 'None'} -> {new_phase}"
        if new_phase == "Failed":
            spec_valid = next((c for c in new.get("conditions", []) if c["type"] == "SpecValid"), {})
            message = f"invalid spec: {spec_valid.get('message', '')}"
        _event(body, kind, reason, message)
    old_cond = {c.get("type"): c.get("status") for c in previous.get("conditions") or []}
    for cond in new.get("conditions", []):
        if cond["type"] == "CoordinatorReady" and old_cond.get("CoordinatorReady") != cond["status"]:
            if cond["status"] == "False" and old_cond.get("CoordinatorReady") == "True":
                _event(body, "Warning", "CoordinatorUnreachable", cond.get("message", ""))


# --------------------------------------------------------------------------- kopf wiring

_RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)


@kopf.on.create(*_RESOURCE, backoff=CONFIG.reconcile_interval)
@kopf.on.update(*_RESOURCE, backoff=CONFIG.reconcile_interval)
@kopf.on.resume(*_RESOURCE, backoff=CONFIG.reconcile_interval)
async def on_change(body: Any, meta: Any, memo: Any, patch: Any, logger: Any, **_: Any) -> None:
    try:
        await reconcile(body, meta, memo, patch, logger)
    except KubeError as exc:
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=CONFIG.reconcile_interval) from exc


@kopf.timer(*_RESOURCE, interval=CONFIG.reconcile_interval, initial_delay=CONFIG.reconcile_interval)
async def on_timer(body: Any, meta: Any, memo: Any, patch: Any, logger: Any, **_: Any) -> None:
    if meta.get("deletionTimestamp"):
        return
    try:
        await reconcile(body, meta, memo, patch, logger)
    except KubeError as exc:
        logger.warning("reconcile failed, retrying in %ss: %s", CONFIG.reconcile_interval, exc)


@kopf.on.delete(*_RESOURCE)
async def on_delete(body: Any, meta: Any, spec: Any, memo: Any, logger: Any, **_: Any) -> None:
    """Finalizer: STOP the fleet gracefully, bounded by drainTimeoutSeconds, before GC."""
    name, namespace = meta["name"], meta["namespace"]
    drain = int((spec or {}).get("drainTimeoutSeconds", 60))
    async with _lock(memo):
        token = await _existing_token(name, namespace)
        address = CONFIG.coordinator_address(name, namespace)
        try:
            link = await _link(memo, address, token or render.derive_token(CONFIG.token_key, namespace, name,
                                                                            meta.get("uid")))
            ack = await link.command("stop", float(max(drain, 1)) + 5.0, drain_timeout=float(drain))
            _event(body, "Normal", "Stopped", f"STOP acknowledged before deletion: {ack.get('state', 'STOPPED')}")
        except (CoordinatorUnavailable, CoordinatorRejected) as exc:
            logger.warning("could not stop the fleet gracefully (%s); children are deleted anyway", exc)
            _event(body, "Warning", "StopFailed", f"could not stop the fleet gracefully: {exc}")
        finally:
            await _drop_link(memo)
