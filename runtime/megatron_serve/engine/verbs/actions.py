"""The lifecycle verbs as the engine does them, behind one entry: ``engine.call(step, body)``.

The engine process (:mod:`.process`) checks a verb against the lifecycle table (which states a step needs, which
one it leads to: :data:`~megatron_serve.wire.lifecycle.STEPS`), finishes the step in flight, and hands the verb's
message to the engine, which answers with the acknowledgement's ``detail`` (``{"error": ...}`` when it refuses); the
process only acknowledges. :data:`ACTIONS` says what each step does here (STOP is the process's own: it drains), and
:data:`REGISTER` what a registration does (the fleet's weights, adapters and suspension, taken on before serving). So
vLLM keeps ``EngineCore`` (requests, steps, and every utility call) apart from ``EngineCoreProc`` (the loop and its
sockets).

The actions work over any :class:`~.served.ServedEngine` (its ``memory`` and ``adapters`` objects, its load and
epoch), so the fleet tests' fake engines answer through this same table. What they change beside the weights and the
pools is :class:`~.served.Serving`'s: where the served weights came from, the suspend level, and what the process's HELLO
says of both.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

from ...errors import RefitFailed
from ...wire.lifecycle import FleetState, Step
from ...wire.lora_names import shown
from ...wire.controls import Control, LoadLora, Refit, ResetPrefixCache, ScaleEp, Suspend, UnloadLora
from ...wire.handshake import HelloAck
from ...wire.rendezvous import RENDEZVOUS_SCHEME

if TYPE_CHECKING:
    from ...weights.sources import WeightSource
    from ..served import ServedEngine

logger = logging.getLogger("megatron_serve.engine_process")

#: The key of a registration's action (its body: the coordinator's ``HelloAck``), beside the lifecycle's steps.
REGISTER = "register"


def call(engine: ServedEngine, step: Step | str, body: Any) -> dict[str, Any]:
    """What ``engine`` does for ``step`` (a lifecycle step but STOP, or :data:`REGISTER`), given the verb's message:
    the acknowledgement's detail."""
    return ACTIONS[step](engine, body)


def _release(engine: ServedEngine, level: int, keep_kv: bool = False) -> int:
    """Release device memory (KV pool; level 2 also weights); with ``keep_kv`` the live requests' KV is kept
    in host memory first. Returns bytes released now."""
    serving = engine.serving
    if serving.suspend_level >= level:
        return 0
    released = engine.memory.suspend(level, keep_kv)
    serving.suspend_level = level
    logger.info("suspended (level %d%s): released %d bytes of device memory", level,
                ", live requests' KV kept in host memory" if keep_kv else "", released)
    return released


def _restore(engine: ServedEngine) -> bool:
    """Bring released device memory back; False when nothing was released."""
    serving = engine.serving
    if not serving.suspend_level:
        return False
    engine.memory.resume()
    serving.suspend_level = 0
    logger.info("resumed: device memory restored, running requests %s",
                "go on over their KV" if engine.load().running else "will be recomputed")
    return True


def _pause(engine: ServedEngine, _body: Control) -> dict[str, Any]:
    load = engine.load()
    return {"running": load.running, "waiting": load.waiting}


def _unpause(engine: ServedEngine, _body: Control) -> dict[str, Any]:
    _restore(engine)
    return {}


def _suspend(engine: ServedEngine, body: Suspend) -> dict[str, Any]:
    level = body.level or 1
    already = engine.serving.suspend_level >= level
    try:
        released = _release(engine, level, bool(body.keep_kv))
    except ValueError as exc:  # a level other than 1 or 2
        return {"error": str(exc)}
    detail: dict[str, Any] = {"released_bytes": released, "level": engine.serving.suspend_level}
    if kept := engine.memory.kept_kv_bytes:
        detail["kept_kv_bytes"] = kept
    if already:
        detail["already_suspended"] = True
    return detail


def _resume(engine: ServedEngine, _body: Control) -> dict[str, Any]:
    return {"resumed": _restore(engine)}


def _note_weights(engine: ServedEngine) -> None:
    """What the next HELLO says about our weights (a restarted coordinator syncs us by it)."""
    serving = engine.serving
    info = serving.info
    info["epoch"] = engine.epoch
    info["weights"] = serving.weights
    info.pop("peer_store", None)
    if (serving.weights or "").startswith(RENDEZVOUS_SCHEME):  # a trainer's: joiners pull them from us
        info["peer_store"] = engine.memory.peers.address(serving.towards)


def _refit(engine: ServedEngine, body: Refit) -> dict[str, Any]:
    """REFIT at a step boundary: phase ``verify`` checks names and shapes only; ``load`` swaps the
    weights in place (read from a directory, or received from a trainer with ``rendezvous``).

    The coordinator verifies on every engine before any engine loads, so a bad source leaves
    the whole fleet on its old weights. A load that fails after verification (a read error, a
    trainer that died mid-transfer) reports which weights this engine holds now
    (:meth:`RefitFailed.facts`): intact, or a mix (epoch -1) that a later refit must complete.
    """
    phase = body.phase or "load"
    source: WeightSource | str = body.source
    if body.rendezvous is not None:
        from ...weights.sharded import rendezvous_source  # noqa: PLC0415 - torch only where an engine lives

        source = rendezvous_source(body.rendezvous, body.source)
    serving = engine.serving
    try:
        if phase == "verify":
            return {"verified_s": round(float(engine.memory.verify_refit(source)), 6)}
        timings = engine.memory.refit(source, body.epoch)
    except Exception as exc:  # noqa: BLE001 - any failure is reported; the fleet decides
        epoch = engine.epoch
        logger.error("REFIT (%s) from %s failed: %s", phase, body.source, exc)
        _note_weights(engine)
        facts = exc.facts() if isinstance(exc, RefitFailed) else {"epoch": epoch, "weights_intact": epoch != -1}
        return {"error": str(exc) or type(exc).__name__, "phase": phase, **facts}
    pushed = body.rendezvous.lora if body.rendezvous is not None else None
    if pushed is not None:  # an adapter version: the base weights (and what HELLO says of them) stay
        logger.info("LoRA adapter %r version %d from %s in %.2fs", pushed.name, pushed.version, body.source,
                    timings["total_s"])
        stored = (engine.adapters.names() or {}).get(pushed.name) if serving.lora_push_dir else None
        return {**{k: round(float(v), 6) for k, v in timings.items() if k != "epoch"},
                "epoch": int(timings["epoch"]), "lora": {"name": pushed.name, "version": pushed.version},
                **({"lora_path": stored} if stored else {})}
    serving.weights = body.source
    _note_weights(engine)
    logger.info("refit: epoch %d from %s in %.2fs (verify %.2fs, load %.2fs)", timings["epoch"], body.source,
                timings["total_s"], timings["verify_s"], timings["load_s"])
    facts = {**{k: round(float(v), 6) for k, v in timings.items() if k not in ("epoch", "drafter_error")},
             "epoch": int(timings["epoch"]), "source": body.source}
    if "drafter_error" in timings:  # the policy changed, the drafter could not (engine.verbs.memory)
        facts["drafter_error"] = timings["drafter_error"]
    if "peer_store" in serving.info:
        facts["peer_store"] = serving.info["peer_store"]
    carried = body.rendezvous.adapters if body.rendezvous is not None else None
    if carried and serving.lora_push_dir:  # where each version was stored, for engines that join later
        served = engine.adapters.names() or {}
        facts["lora_paths"] = {push.name: served[push.name] for push in carried if push.name in served}
    return facts


def _lora(engine: ServedEngine, body: LoadLora | UnloadLora) -> dict[str, Any]:
    """LOAD_LORA (phase ``verify`` reads and checks the adapter, ``load`` serves it) and UNLOAD_LORA.

    Unloading a name this engine does not serve is not an error here (an engine that joined after the
    adapter was loaded elsewhere, or one without ``enable_lora``): the coordinator refuses an UNLOAD_LORA
    that no engine can do.
    Every acknowledgement carries the adapters served afterwards (``loras``).
    """
    adapters = engine.adapters
    try:
        if isinstance(body, UnloadLora):
            served = adapters.names()
            if served is None or body.lora_name not in served:
                return {"absent": True, **({} if served is None else {"loras": served})}
            adapters.unload(body.lora_name)
            detail: dict[str, Any] = {}
        elif body.phase == "verify":
            detail = {"read_s": round(adapters.verify(body.lora_name, body.lora_path), 6)}
        else:
            detail = {"load_s": round(adapters.load(body.lora_name, body.lora_path), 6)}
        engine.serving.info["loras"] = adapters.names()  # what the next HELLO says
    except Exception as exc:  # noqa: BLE001 - any refusal is reported; the fleet decides
        logger.warning("%s %s refused: %s", "UNLOAD_LORA" if isinstance(body, UnloadLora) else "LOAD_LORA",
                       shown(body.lora_name), shown(str(exc), 600))
        return {"error": str(exc) or type(exc).__name__}
    return {**detail, "loras": adapters.names() or {}}


def _reset_prefix_cache(engine: ServedEngine, body: ResetPrefixCache) -> dict[str, Any]:
    """RESET_PREFIX_CACHE between two steps: ``{"reset": true}`` once no cached block of any tier can be found
    again; ``{"reset": false, "held_blocks": n}`` when running requests hold blocks and the verb did not say
    ``reset_running_requests`` (vLLM's rule: its reset needs every block free)."""
    return engine.memory.reset_prefix_cache(bool(body.reset_running_requests))


def _scale_ep(engine: ServedEngine, body: ScaleEp) -> dict[str, Any]:
    """SCALE_EP between two steps: this rank's part of its expert-parallel group's change of size
    (:meth:`~.group.survival.GroupSurvival.scale`); a rank that leaves hands its requests back in the
    acknowledgement (``handed_back``: the coordinator resubmits them) and exits at the group's next turn."""
    detail = engine.memory.scale_expert_group(body.size)
    if detail.get("leaving"):
        detail["handed_back"] = [record.request_id for record in engine.take_unfinished_requests()]
    return detail


def _status_detail(engine: ServedEngine, _body: Control) -> dict[str, Any]:
    """STATUS_DETAIL between two steps: what this engine holds at that moment (its load, which a heartbeat reports
    up to a second late) and what the verbs made of it (its weights' epoch and source, suspend level, adapters)."""
    serving = engine.serving
    return {**dataclasses.asdict(engine.load()), "epoch": engine.epoch, "weights": serving.weights,
            "suspend_level": serving.suspend_level, "loras": engine.adapters.names(),
            "kept_kv_bytes": engine.memory.kept_kv_bytes}


def _register(engine: ServedEngine, ack: HelloAck) -> dict[str, Any]:
    """At registration: the fleet's current weights (when ours differ) and LoRA adapters, then its suspension (or
    none). ``{"error": why}`` when the weights cannot be loaded: the engine cannot serve this fleet."""
    if ack.refit and (problem := _sync_weights(engine, ack.refit)) is not None:
        return {"error": problem}
    if ack.loras:
        _sync_loras(engine, ack.loras)
    if ack.state == FleetState.SUSPENDED.value:
        _release(engine, ack.suspend_level or 1)
    else:
        _restore(engine)
    return {}


def _sync_weights(engine: ServedEngine, refit: dict[str, Any]) -> str | None:
    """Load the fleet's current weights if ours differ; why not, when that fails."""
    source, epoch = refit.get("source"), refit.get("epoch")
    if not isinstance(source, str) or not isinstance(epoch, int) or isinstance(epoch, bool):
        logger.warning("ignoring a malformed refit instruction in HELLO_ACK: %r", refit)
        return None
    serving = engine.serving
    if source == serving.weights and epoch == engine.epoch:
        return None
    peer = refit.get("peer")  # weights a trainer sent: from a live engine of our layout
    logger.info("the fleet serves epoch %d from %s: loading it before serving%s", epoch, source,
                f" from engine {peer.get('engine_id')}" if isinstance(peer, dict) else "")
    try:
        if isinstance(peer, dict):
            from ...weights.peer_pull import PeerSource  # noqa: PLC0415 - torch only where an engine lives

            timings = engine.memory.refit(PeerSource(str(peer["address"]), str(peer["prefix"]), epoch,
                                                     float(peer["timeout_s"]), source), epoch)
        else:
            timings = engine.memory.refit(source, epoch)
    except Exception as exc:  # noqa: BLE001
        return (f"cannot load the fleet's current weights (epoch {epoch}) from {source}: {exc} "
                "(start this engine with a model of the fleet's architecture)")
    serving.weights = source
    _note_weights(engine)
    logger.info("loaded epoch %d in %.2fs", epoch, timings["total_s"])
    return None


def _sync_loras(engine: ServedEngine, loras: dict[str, str]) -> None:
    """Load the LoRA adapters the fleet was told to serve while this engine was away (the names it serves already
    are kept). One it cannot load is logged and left out: the coordinator routes that adapter's requests to the
    engines serving it."""
    adapters = engine.adapters
    served = adapters.names()
    if served is None:
        logger.warning("the fleet serves LoRA adapters (%s) but this engine was started without enable_lora",
                       ", ".join(sorted(loras)))
        return
    for name, path in loras.items():
        if name in served:
            continue
        try:
            adapters.load(name, path)
        except Exception as exc:  # noqa: BLE001 - this engine serves without it; the others have it
            logger.warning("cannot load the fleet's LoRA adapter %s from %s: %s", shown(name), shown(path),
                           shown(str(exc), 600))
            continue
        logger.info("loaded the fleet's LoRA adapter %s from %s", shown(name), shown(path))
    engine.serving.info["loras"] = adapters.names()


#: What each step of the lifecycle table does in the engine (a test checks that every step but STOP has one), and
#: what a registration does.
ACTIONS: dict[Step | str, Callable[[ServedEngine, Any], dict[str, Any]]] = {
    Step.PAUSE: _pause,
    Step.UNPAUSE: _unpause,
    Step.SUSPEND: _suspend,
    Step.RESUME: _resume,
    Step.REFIT_VERIFY: _refit,
    Step.REFIT_LOAD: _refit,
    Step.LORA_VERIFY: _lora,
    Step.LORA_LOAD: _lora,
    Step.LORA_UNLOAD: _lora,
    Step.RESET_PREFIX_CACHE: _reset_prefix_cache,
    Step.SCALE_EP: _scale_ep,
    Step.STATUS_DETAIL: _status_detail,
    REGISTER: _register,
}
