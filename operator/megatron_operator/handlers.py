"""kopf wiring of the megatron-serve operator (``megatron-serve operator`` loads this module).

The only module that knows kopf: it registers the handlers, keeps one :class:`ResourceState` per
resource in kopf's ``memo``, and turns a pass's result into kopf's status patch and events. What a
pass does is :mod:`megatron_operator.reconcile_pass` (by level, not by edge: create, update and
resume handlers run it at once, and a timer runs it every ``MEGATRON_OPERATOR_RECONCILE_INTERVAL``
seconds, so restarts of the operator or of a coordinator converge). Deleting a resource runs a
finalizer that STOPs the fleet, bounded by ``drainTimeoutSeconds``.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import crd
from .config import OperatorConfig
from .kube import Kube, KubeError
from .reconcile import Event
from .reconcile_pass import PassResult, ResourceState, run_pass, stop_fleet

_log = logging.getLogger("megatron_operator")

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
    settings.peering.lifetime = max(1, round(CONFIG.peering_lifetime))  # kopf counts it in whole seconds
    if CONFIG.peering_priority is not None:  # after kopf's --priority, which cli refuses beside it
        settings.peering.priority = CONFIG.peering_priority
    settings.execution.max_workers = 8
    # A deletion waits for a running timer pass to end: look again after a second, not a minute.
    settings.background.cancellation_polling = 1.0


@kopf.on.probe(id="ready")
def probe_ready(**_: Any) -> bool:
    return True


def _resource_state(memo: kopf.Memo) -> ResourceState:
    state = memo.get("megatron")
    if not isinstance(state, ResourceState):
        state = memo["megatron"] = ResourceState()
    return state


def _resource(body: kopf.Body) -> dict[str, Any]:
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": dict(body.meta),
            "spec": dict(body.spec), "status": dict(body.status)}


def _post(body: kopf.Body, events: list[Event]) -> None:
    for kind, reason, message in events:
        try:
            kopf.event(body, type=kind, reason=reason, message=message)
        except Exception as exc:  # events are best effort
            _log.debug("could not post event %s: %s", reason, exc)


def _apply(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, result: PassResult) -> None:
    if result.status:
        patch.setdefault("status", {}).update(result.status)
    _post(body, result.events)
    _resource_state(memo).api_error = None


def _refused(body: kopf.Body, memo: kopf.Memo, exc: KubeError) -> str:
    """The API server refused one of the pass's calls (RBAC, admission, validation): a Warning Event on the
    resource says which (kopf only logs a handler's failure, and ``kubectl describe`` would show nothing), once per
    distinct refusal rather than once per retry."""
    message = f"Kubernetes API: {exc}"
    state = _resource_state(memo)
    if state.api_error != message:
        state.api_error = message
        _post(body, [("Warning", "KubernetesAPIError", message)])
    return message


# --------------------------------------------------------------------------- kopf wiring

_RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)


@kopf.on.create(*_RESOURCE, backoff=CONFIG.reconcile_interval)
@kopf.on.update(*_RESOURCE, backoff=CONFIG.reconcile_interval)
@kopf.on.resume(*_RESOURCE, backoff=CONFIG.reconcile_interval)
async def on_change(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    try:
        result = await run_pass(_resource(body), _resource_state(memo), kube(), CONFIG, logger)
    except KubeError as exc:
        raise kopf.TemporaryError(_refused(body, memo, exc), delay=CONFIG.reconcile_interval) from exc
    _apply(body, memo, patch, result)


@kopf.timer(*_RESOURCE, interval=CONFIG.reconcile_interval, initial_delay=CONFIG.reconcile_interval)
async def on_timer(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    if body.meta.get("deletionTimestamp"):
        return
    try:
        result = await run_pass(_resource(body), _resource_state(memo), kube(), CONFIG, logger)
    except KubeError as exc:
        logger.warning("reconcile failed, retrying in %ss: %s", CONFIG.reconcile_interval, _refused(body, memo, exc))
        return
    _apply(body, memo, patch, result)


@kopf.on.delete(*_RESOURCE)
async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Finalizer: STOP the fleet gracefully, bounded by drainTimeoutSeconds, before GC."""
    _post(body, await stop_fleet(_resource(body), _resource_state(memo), kube(), CONFIG, logger))
