"""The refit policy: serve the spec's weights by refitting in place where that can work, else by rolling pods.

``status.model`` records the weights served (``path``, ``revision``, ``epoch``) and the path the pod
templates carry (``templatePath``). The templates keep ``templatePath`` across refits, so a refit
never rolls a pod: engines that start later load the template's weights and, at registration, the
coordinator's current ones.

* A changed ``spec.model.path``/``revision`` on a fleet that serves (coordinator reachable, an
  engine connected, not shutting down) is refitted in place: PAUSE (if running), REFIT, UNPAUSE.
* A new ``spec.model.hub`` is not: its files exist only in pods whose init container fetched them,
  so the template takes it (``templateHub``) and the pods roll.
* If an engine refuses the weights (another architecture), the fleet keeps the old ones and the
  template takes the new path instead: the usual drain-first rolling replacement.
* With nothing serving, the template takes the new path at once.
* By level: a coordinator whose epoch is behind ``status.model.epoch`` (it restarted along with its
  engines) is refitted again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import lifecycle, status
from .coordinator_link import CoordinatorLink, CoordinatorRejected, CoordinatorUnavailable, RefitFailed
from .reconcile import Event
from .spec import InferenceSpec


@dataclass
class Weights:
    """What the policy decided: the new ``status.model`` and what to report."""

    model: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    link_lost: bool = False  # the link failed: drop it, the next pass reconnects


def recorded_model(previous_status: dict[str, Any], spec: InferenceSpec,
                   remembered: dict[str, Any] | None) -> dict[str, Any]:
    """``status.model`` as recorded; for a new resource, the spec's model as started (epoch 0).

    What this process recorded last (``remembered``) wins over the body's status: kopf applies a
    handler's status patch after the handler returns, so the next pass may still see the older
    status, and a refit must not run twice.
    """
    model = dict(remembered or previous_status.get("model") or {})
    if not model.get("templatePath"):
        model = started_with(spec)
    return model


def started_with(spec: InferenceSpec) -> dict[str, Any]:
    """``status.model`` of pods (re)started from the spec's model: the template carries its path (and the Hub
    id its init container fetches there)."""
    model: dict[str, Any] = {"path": spec.model_path, "epoch": 0, "templatePath": spec.model_path}
    if spec.model_revision is not None:
        model["revision"] = spec.model_revision
    if spec.model_hub is not None:
        model["hub"] = model["templateHub"] = spec.model_hub
    return model


async def sync_weights(link: CoordinatorLink | None, spec: InferenceSpec, model: dict[str, Any], state: str | None,
                       coordinator_status: dict[str, Any] | None, target: str, command_timeout: float) -> Weights:
    """Serve the spec's weights (see the module docstring); ``model`` is the recorded ``status.model``."""
    wanted = (spec.model_path, spec.model_revision, spec.model_hub)
    changed = (model.get("path"), model.get("revision"), model.get("hub")) != wanted
    reply = coordinator_status or {}
    fleet_epoch = reply.get("epoch")
    serving = (link is not None and target != lifecycle.STOPPED
               and state in (lifecycle.RUNNING, lifecycle.PAUSED, lifecycle.SUSPENDED) and bool(reply.get("engines")))
    epoch = int(model.get("epoch") or 0)
    result = Weights(model)
    if not changed:
        if link is not None and serving and isinstance(fleet_epoch, int) and fleet_epoch < epoch:
            try:
                await _refit(link, state, model["path"], epoch, command_timeout)
            except (CoordinatorRejected, CoordinatorUnavailable) as exc:
                result.link_lost = isinstance(exc, CoordinatorUnavailable)
                result.events.append(("Warning", "RefitFailed",
                                      f"could not restore the weights of epoch {epoch}: {exc}"))
            else:
                result.events.append(("Normal", "Refitted", f"the coordinator reported epoch {fleet_epoch}: weights "
                                                            f"of epoch {epoch} ({model['path']}) loaded again"))
        return result
    if link is None:
        return result  # the coordinator is unreachable: decide once it answers
    if not serving or spec.model_hub:  # new Hub files reach only pods that start (their init container fetches)
        return Weights(started_with(spec))
    epoch = max(epoch, fleet_epoch if isinstance(fleet_epoch, int) else 0) + 1
    try:
        ack = await _refit(link, state, spec.model_path, epoch, command_timeout)
    except RefitFailed as exc:
        return Weights(started_with(spec), [("Warning", "RefitFailed",
                                              f"{exc}; replacing the engine pods instead (drain first)")])
    except (CoordinatorRejected, CoordinatorUnavailable) as exc:
        result.link_lost = isinstance(exc, CoordinatorUnavailable)
        result.events.append(("Warning", "RefitFailed", f"refit to {spec.model_path} not done, retrying: {exc}"))
        return result
    detail = ack.get("detail") or {}
    new = {**started_with(spec), "epoch": int(detail.get("epoch", epoch)), "refittedAt": status.now_iso(),
           "templatePath": model["templatePath"]}
    if model.get("templateHub"):  # the pods keep fetching what their template fetches
        new["templateHub"] = model["templateHub"]
    engines = detail.get("engines") or {}
    slowest = max((float(f.get("total_s") or 0.0) for f in engines.values() if isinstance(f, dict)), default=0.0)
    revision = f" (revision {spec.model_revision})" if spec.model_revision else ""
    return Weights(new, [("Normal", "Refitted", f"weights refitted in place from {spec.model_path}{revision}: epoch "
                                                f"{new['epoch']} on {len(engines)} engine group(s), slowest "
                                                f"{slowest:.1f}s; no pod replaced")])


async def _refit(link: CoordinatorLink, state: str | None, source: str, epoch: int, timeout: float) -> dict[str, Any]:
    """PAUSE (only if running), REFIT, and UNPAUSE again (also after a refused REFIT).

    When the link fails midway, the lifecycle walk of a later pass puts the state right.
    """
    running = state == lifecycle.RUNNING
    if running:
        await link.command("pause", timeout)
    try:
        return await link.refit(source, epoch, timeout)
    finally:
        if running:
            await link.command("unpause", timeout)
