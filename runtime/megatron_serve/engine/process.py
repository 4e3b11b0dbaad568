"""An engine process: one ``DynamicInferenceEngine`` serving the coordinator (``megatron-serve engine``).

Two threads with one job each:

* :class:`~megatron_serve.engine.link.CoordinatorLink` (background thread) owns the DEALER socket
  (HELLO, heartbeats, reconnects; see its module).
* :class:`EngineProcess` (main thread) is a thin loop over the engine interface
  (:class:`~megatron_serve.engine.served.ServedEngine`): apply incoming
  messages at step boundaries, call ``engine.step()`` while RUNNING, report every step's outputs.
  Lifecycle verbs are applied between steps, so PAUSE always takes effect at a step boundary. The
  loop counts its iterations (it never blocks for more than 50 ms while idle) and the heartbeats
  report that count as ``progress``: since they come from the link thread, the count is how the
  coordinator tells a hung step loop from a live one.

SIGTERM: send DRAINING (the coordinator stops routing here), keep stepping until the work is done
or ``drain_timeout`` passes, hand the rest back (the coordinator re-queues it, continuing from the
tokens already streamed) and exit 0. STOP from the coordinator does the same and acknowledges.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlparse

import msgspec
import zmq

from ..errors import EngineGroupLost, RefitFailed
from ..wire.lora_names import shown
from ..wire.kv_blocks import wants_remote_decode, wants_remote_prefill
from ..wire.lifecycle import ENGINE_DRAINING, STEPS, FleetState, Step, engine_state_after
from .link import CoordinatorLink
from ..heap import freeze_startup_heap
from .output import step_delta, step_messages
from .served import EngineStepResult, ServedEngine
from .group.turns import HeldVerb, held
from ..wire.messages import (RENDEZVOUS_SCHEME, Body, Control, EngineStepOut, EngineSubmit, HelloAck, KVEvents, LoadLora,
                             Refit, RequestDeltaOut, Stop, Suspend, UnloadLora)
from ..wire.protocol import HEADER_VERBS, Header, ProtocolError, Role, step_of
from ..wire.request import EngineRequest, FinalRecord, FinishReason, RequestStatus

if TYPE_CHECKING:
    from ..weights.sources import WeightSource

logger = logging.getLogger("megatron_serve.engine_process")

class _Named(msgspec.Struct):
    request_id: str


_ENGINE_REQUEST = msgspec.msgpack.Decoder(EngineRequest)
_REQUEST_ID = msgspec.msgpack.Decoder(_Named)  # what names a request this engine cannot read

DEFAULT_DRAIN_TIMEOUT = 30.0
_HANDBACK_ACK_WAIT = 5.0


class EngineProcess:
    """Drives one engine for the coordinator. ``run()`` returns the process exit code."""

    def __init__(
        self,
        engine: ServedEngine,
        address: str,
        *,
        token: str | None = None,
        group: int | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        heartbeat_interval: float = 1.0,
        coordinator_timeout: float = 10.0,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.drain_timeout = float(drain_timeout)
        engine_facts = engine.facts()
        facts = {"pid": os.getpid(), "host": socket.gethostname(), **engine_facts.hello_info(), **(info or {})}
        self.weights_source: str | None = facts.get("model")  # where the served weights came from (REFIT replaces it)
        facts["epoch"] = engine.epoch
        facts["weights"] = self.weights_source
        loras = engine.adapters.names()
        if loras is not None:  # the adapters it serves: routed to at once, before its first heartbeat
            facts["loras"] = loras
        hello = {"role": Role.ENGINE.value, "engine_group": group, "capacity": engine_facts.capacity, "info": facts}
        self.link = CoordinatorLink(address, hello, token=token, heartbeat_interval=heartbeat_interval,
                                    coordinator_timeout=coordinator_timeout)
        self.state = FleetState.PAUSED  # until the coordinator says otherwise
        self.suspend_level = 0
        self.session = 0
        self.engine_id: str | None = None
        self.drain_deadline: float | None = None
        self.stop_control_id: Any = None
        self.sigterm = False
        self.fatal: str | None = None
        self.steps = 0
        self.iterations = 0  # of the loop in run(): the heartbeat's ``progress``
        self._handback_acked = False
        self.held: HeldVerb | None = None  # a trainer's refit, until every data-parallel rank holds its copy
        self._stats_at = 0.0

    # -- signals

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: Any) -> None:
            if self.sigterm:  # second signal: stop waiting
                self.drain_deadline = 0.0
            self.sigterm = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    # -- loop

    def run(self) -> int:
        self.link.start()
        stepped = False
        try:
            while True:
                self.iterations += 1
                busy = self.state is FleetState.RUNNING and self.engine.has_unfinished_requests()
                self._handle_inbox(timeout=0.0 if busy or stepped else 0.05)
                if self.fatal:
                    logger.error("%s", self.fatal)
                    return 1
                if self.sigterm and self.drain_deadline is None:
                    self._begin_drain(self.drain_timeout, "SIGTERM")
                if self.drain_deadline is not None and self._drain_finished():
                    return 0
                # data-parallel attention ranks step together while any of them has work (engine.group.data_parallel):
                # an idle one steps too, and does not wait on its inbox meanwhile; a verb that joins them all
                # runs at the turn in which every one holds its copy
                turn = self.engine.group_turn(self.state is FleetState.RUNNING
                                              and self.engine.has_unfinished_requests(), self.held is not None)
                if self.held is not None and (turn.verb or self.held.expired()):
                    verb, self.held = self.held, None
                    if turn.verb:
                        self._on_step(verb.header, verb.body)
                    else:
                        self._ack(verb.body.control_id, verb.refusal(self.engine.epoch))
                stepped = turn.step
                if stepped:
                    self._step()
                self._publish_stats()
        finally:
            self.link.close()

    def _handle_inbox(self, timeout: float) -> None:
        try:
            event = self.link.inbox.get(timeout=timeout) if timeout > 0 else self.link.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = event[0]
            if kind == "fatal":
                self.fatal = event[1]
                return
            if kind == "registered":
                self._on_registered(event[1], event[2])
            elif kind == "message" and event[3] == self.session:
                self._on_coordinator(event[1], event[2])
            try:
                event = self.link.inbox.get_nowait()
            except queue.Empty:
                return

    def _send(self, header: Header, body: Body | dict[str, Any]) -> None:
        if self.session:
            self.link.send(header, body, self.session)

    def _on_registered(self, ack: HelloAck, session: int) -> None:
        # Registering may take minutes (loading the fleet's weights, resuming): meanwhile the loop's
        # count says nothing, and heartbeats carry none (the coordinator reads that as "unknown").
        self.link.stats = {k: v for k, v in self.link.stats.items() if k != "progress"}
        if self.session:
            self.engine.kv_transfer.clear()
            dropped = self.engine.take_unfinished_requests()
            logger.warning("registered again with coordinator %s: dropped %d in-flight request(s) "
                           "(the coordinator re-queued them)", ack.coordinator_id, len(dropped))
        self.session = session
        self.engine_id = ack.engine_id
        self.engine.kv_events.attach(self._send_kv_events)  # the coordinator's index starts from what it holds now
        logger.info("registered with coordinator %s as %s (group %s), state %s", ack.coordinator_id,
                    self.engine_id, ack.engine_group, ack.state)
        if ack.refit and not self._sync_weights(ack.refit):
            return
        if ack.loras:
            self._sync_loras(ack.loras)
        target = ack.state
        if target == FleetState.SUSPENDED.value:
            self._suspend(ack.suspend_level or 1)
            self.state = FleetState.SUSPENDED
        else:
            self._restore()
            # A STOPPED coordinator: wait paused until it is restarted with UNPAUSE.
            self.state = FleetState.RUNNING if target == FleetState.RUNNING.value else FleetState.PAUSED
        if self.drain_deadline is not None:
            self._send(Header.DRAINING, {"engine_id": self.engine_id})
        self._publish_stats(force=True)

    def _on_coordinator(self, header: Header, body: Any) -> None:
        if header is Header.ENGINE_SUBMIT:
            self._add(body)
        elif header is Header.KV_BLOCKS:
            self.engine.kv_transfer.arrive(body)
        elif header is Header.ABORT:
            self.engine.abort_request(body.request_id)
        elif header is Header.HANDBACK:
            self._handback_acked = True
        elif header in HEADER_VERBS and (verb := held(header, body)) is not None:
            self.held = verb  # run() acts on it (engine.group.data_parallel)
        elif header in HEADER_VERBS:
            self._on_step(header, body)
        elif header is Header.PEER_WEIGHTS:  # a joiner of our layout pulls our weights, now, between two steps
            self.engine.memory.peers.share(body, self.engine.epoch)

    def _add(self, submit: EngineSubmit) -> None:
        """Serve a request handed over in ``ENGINE_SUBMIT``; one this engine cannot read fails at once. Its KV
        goes on after its first token when it asks so, or it starts on the blocks it brings (engine.kv_transfer).
        """
        data = submit.request
        try:
            request = _ENGINE_REQUEST.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            logger.error("unreadable request from the coordinator: %s", exc)
            try:
                request_id = _REQUEST_ID.decode(data).request_id
            except (msgspec.ValidationError, msgspec.DecodeError):
                return  # nothing names it: the coordinator's stall check ends it
            failed = FinalRecord(request_id=request_id, status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR,
                                 error=f"engine could not read the request: {exc}", finish_time=time.time())
            self._send(Header.ENGINE_STEP, EngineStepOut(engine_id=self.engine_id, outputs=[
                RequestDeltaOut(request_id=request_id, new_tokens=[], finished=True, request=failed)]))
            return
        if wants_remote_decode(submit.kv_transfer_params):
            self.engine.kv_transfer.send_after_prefill(request.request_id)
        self.engine.add_request(request)
        if wants_remote_prefill(submit.kv_transfer_params):
            self.engine.receive_kv(request.request_id)
        else:
            self.engine.kv_transfer.discard(request.request_id)

    def _step(self, settle: bool = False) -> None:
        """One engine step, or with ``settle`` only the finishing of the step in flight (overlapped scheduling:
        called before a verb or a hand-back acts, so the tokens the device already sampled are delivered)."""
        try:
            outputs = self.engine.sync() if settle else self.engine.step()
        except EngineGroupLost:
            # Stepping again is impossible: exit, so the coordinator re-queues this group's requests.
            logger.exception("engine group lost a rank; exiting so its requests move to other groups")
            raise SystemExit(1) from None
        except Exception as exc:  # an engine bug or device failure: fail what ran, keep serving
            logger.exception("engine step failed")
            why = f"engine step failed: {type(exc).__name__}: {exc}"
            payload = [RequestDeltaOut(request_id=r.request_id, new_tokens=[], finished=True, request=r.failed(why))
                       for r in self.engine.take_unfinished_requests()]
            self._send(Header.ENGINE_STEP, EngineStepOut(engine_id=self.engine_id, outputs=payload))
            return
        self.steps += 0 if settle else 1
        self._report(outputs)

    def _report(self, outputs: Sequence[EngineStepResult]) -> None:
        """Send one step's outputs to the coordinator: a delta per request, in one message (several when prompt
        scores would make it large: :func:`~.output.step_messages`). A prefilled request's blocks go first, so
        that the coordinator holds them when it reads that the request left this engine."""
        for blocks in self.engine.kv_transfer.take(self.engine_id or ""):
            self._send(Header.KV_BLOCKS, blocks)
        if outputs:
            for deltas in step_messages([step_delta(out) for out in outputs]):
                self._send(Header.ENGINE_STEP, EngineStepOut(engine_id=self.engine_id, outputs=deltas))

    def _publish_stats(self, force: bool = False) -> None:
        """Refresh what the next heartbeat reports (at most every 0.2 s: heartbeats go once a second).

        The engine's ``metrics_snapshot()`` (cumulative counters and histogram buckets,
        :mod:`megatron_serve.wire.engine_stats`; None where it keeps none) travels as the heartbeat's ``metrics``.
        """
        self.engine.kv_events.flush()  # what a verb or a step changed in the KV tiers, before the heartbeat says so
        now = time.monotonic()
        if not force and now - self._stats_at < 0.2:
            return
        self._stats_at = now
        e = self.engine
        load = e.load()
        stats: dict[str, Any] = {"steps": self.steps, "suspend_level": self.suspend_level, "epoch": e.epoch,
                                 "kv_events_seq": e.kv_events.seq_of(self._send_kv_events)}
        loras = e.adapters.names()
        if loras is not None:  # the adapters it serves (name -> directory): the coordinator routes by them
            stats["loras"] = loras
        if "peer_store" in self.link.hello["info"]:  # joiners of our layout pull our weights from there
            stats["peer_store"] = self.link.hello["info"]["peer_store"]
        self.link.stats = {
            "state": ENGINE_DRAINING if self.drain_deadline is not None else self.state.value,
            "running": load.running, "waiting": load.waiting,
            "kv_blocks_free": load.kv_blocks_free, "kv_blocks_total": load.kv_blocks_total,
            # prefix-cache counters: prompt tokens skipped thanks to the cache, tokens run through the model
            "cached_tokens": load.cached_tokens,
            "computed_tokens": load.computed_tokens,
            "stats": stats,
            "progress": self.iterations,
        }
        snapshot = e.metrics_snapshot()
        if snapshot is not None:
            self.link.stats["metrics"] = snapshot

    def _send_kv_events(self, seq: int, payload: bytes) -> None:
        self._send(Header.KV_EVENTS, KVEvents(engine_id=self.engine_id or "", seq=seq, batch=msgspec.Raw(payload)))

    # -- lifecycle

    def _ack(self, control_id: Any, detail: dict[str, Any]) -> None:
        self._publish_stats(force=True)  # no heartbeat after the ack may carry the old state
        self._send(Header.CONTROL_ACK, {"control_id": control_id, "state": self.state.value, "detail": detail,
                                        "engine_id": self.engine_id})

    def _suspend(self, level: int, keep_kv: bool = False) -> int:
        """Release device memory (KV pool; level 2 also weights); with ``keep_kv`` the live requests' KV is kept
        in host memory first. Returns bytes released now."""
        if self.suspend_level >= level:
            return 0
        released = self.engine.memory.suspend(level, keep_kv)
        self.suspend_level = level
        logger.info("suspended (level %d%s): released %d bytes of device memory", level,
                    ", live requests' KV kept in host memory" if keep_kv else "", released)
        return released

    def _restore(self) -> bool:
        """Bring released device memory back; False when nothing was released."""
        if not self.suspend_level:
            return False
        self.engine.memory.resume()
        self.suspend_level = 0
        logger.info("resumed: device memory restored, running requests %s",
                    "go on over their KV" if self.engine.load().running else "will be recomputed")
        return True

    def _on_step(self, header: Header, body: Control) -> None:
        """One lifecycle step at a step boundary: the table says where it leads, the action does the work."""
        control_id = body.control_id
        try:
            step = step_of(header, body.phase if isinstance(body, (Refit, LoadLora)) else None)
        except ProtocolError as exc:
            self._ack(control_id, {"error": str(exc)})
            return
        spec = STEPS[step]
        self._step(settle=True)
        if self.state not in spec.requires:
            self._ack(control_id, {"error": f"{step.value} needs an engine that is "
                                            f"{' or '.join(sorted(s.value for s in spec.requires))}; "
                                            f"this one is {self.state.value}"})
            return
        detail = self._STEP_ACTIONS[step](self, body)
        if detail is None:  # STOP: acknowledged once drained (see _drain_finished)
            return
        if "error" not in detail:
            self.state = engine_state_after(step, self.state)
        self._ack(control_id, detail)

    def _pause_action(self, _body: Control) -> dict[str, Any]:
        load = self.engine.load()
        return {"running": load.running, "waiting": load.waiting}

    def _unpause_action(self, _body: Control) -> dict[str, Any]:
        self._restore()
        return {}

    def _suspend_action(self, body: Suspend) -> dict[str, Any]:
        level = body.level or 1
        already = self.suspend_level >= level
        try:
            released = self._suspend(level, bool(body.keep_kv))
        except ValueError as exc:  # a level other than 1 or 2
            return {"error": str(exc)}
        detail: dict[str, Any] = {"released_bytes": released, "level": self.suspend_level}
        if kept := self.engine.memory.kept_kv_bytes:
            detail["kept_kv_bytes"] = kept
        if already:
            detail["already_suspended"] = True
        return detail

    def _resume_action(self, _body: Control) -> dict[str, Any]:
        return {"resumed": self._restore()}

    def _stop_action(self, body: Stop) -> None:
        self.stop_control_id = body.control_id
        timeout = body.drain_timeout
        self._begin_drain(self.drain_timeout if timeout is None else float(timeout), "STOP")

    # -- weight refit

    def _note_weights(self) -> None:
        """What the next HELLO says about our weights (a restarted coordinator syncs us by it)."""
        info = self.link.hello["info"]
        info["epoch"] = self.engine.epoch
        info["weights"] = self.weights_source
        info.pop("peer_store", None)
        if (self.weights_source or "").startswith(RENDEZVOUS_SCHEME):  # a trainer's: joiners pull them from us
            info["peer_store"] = self.engine.memory.peers.address(urlparse(self.link.address).hostname or "")

    def _refit_action(self, body: Refit) -> dict[str, Any]:
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
            from ..weights.sharded import rendezvous_source  # noqa: PLC0415 - torch only where an engine lives

            source = rendezvous_source(body.rendezvous, body.source)
        try:
            if phase == "verify":
                return {"verified_s": round(float(self.engine.memory.verify_refit(source)), 6)}
            timings = self.engine.memory.refit(source, body.epoch)
        except Exception as exc:  # noqa: BLE001 - any failure is reported; the fleet decides
            epoch = self.engine.epoch
            logger.error("REFIT (%s) from %s failed: %s", phase, body.source, exc)
            self._note_weights()
            facts = exc.facts() if isinstance(exc, RefitFailed) else {"epoch": epoch, "weights_intact": epoch != -1}
            return {"error": str(exc) or type(exc).__name__, "phase": phase, **facts}
        pushed = body.rendezvous.lora if body.rendezvous is not None else None
        if pushed is not None:  # an adapter version: the base weights (and what HELLO says of them) stay
            logger.info("LoRA adapter %r version %d from %s in %.2fs", pushed.name, pushed.version, body.source,
                        timings["total_s"])
            stored = (self.engine.adapters.names() or {}).get(pushed.name) if self.engine.config.lora_push_dir else None
            return {**{k: round(float(v), 6) for k, v in timings.items() if k != "epoch"},
                    "epoch": int(timings["epoch"]), "lora": {"name": pushed.name, "version": pushed.version},
                    **({"lora_path": stored} if stored else {})}
        self.weights_source = body.source
        self._note_weights()
        logger.info("refit: epoch %d from %s in %.2fs (verify %.2fs, load %.2fs)", timings["epoch"], body.source,
                    timings["total_s"], timings["verify_s"], timings["load_s"])
        facts = {**{k: round(float(v), 6) for k, v in timings.items() if k not in ("epoch", "drafter_error")},
                 "epoch": int(timings["epoch"]), "source": body.source}
        if "drafter_error" in timings:  # the policy changed, the drafter could not (engine.memory_verbs)
            facts["drafter_error"] = timings["drafter_error"]
        if "peer_store" in self.link.hello["info"]:
            facts["peer_store"] = self.link.hello["info"]["peer_store"]
        carried = body.rendezvous.adapters if body.rendezvous is not None else None
        if carried and self.engine.config.lora_push_dir:  # where each version was stored, for engines that join later
            served = self.engine.lora_adapters() or {}
            facts["lora_paths"] = {push.name: served[push.name] for push in carried if push.name in served}
        return facts

    # -- LoRA adapters

    def _lora_action(self, body: LoadLora | UnloadLora) -> dict[str, Any]:
        """LOAD_LORA (phase ``verify`` reads and checks the adapter, ``load`` serves it) and UNLOAD_LORA.

        Unloading a name this engine does not serve is not an error here (an engine that joined after the
        adapter was loaded elsewhere, or one without ``enable_lora``): the coordinator refuses an UNLOAD_LORA
        that no engine can do.
        Every acknowledgement carries the adapters served afterwards (``loras``).
        """
        adapters = self.engine.adapters
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
            self.link.hello["info"]["loras"] = adapters.names()  # what the next HELLO says
        except Exception as exc:  # noqa: BLE001 - any refusal is reported; the fleet decides
            logger.warning("%s %s refused: %s", "UNLOAD_LORA" if isinstance(body, UnloadLora) else "LOAD_LORA",
                           shown(body.lora_name), shown(str(exc), 600))
            return {"error": str(exc) or type(exc).__name__}
        return {**detail, "loras": adapters.names() or {}}

    #: What each step of the lifecycle table does here (a test checks that every step has one).
    _STEP_ACTIONS: dict[Step, Callable[["EngineProcess", Any], dict[str, Any] | None]] = {
        Step.PAUSE: _pause_action,
        Step.UNPAUSE: _unpause_action,
        Step.SUSPEND: _suspend_action,
        Step.RESUME: _resume_action,
        Step.STOP: _stop_action,
        Step.REFIT_VERIFY: _refit_action,
        Step.REFIT_LOAD: _refit_action,
        Step.LORA_VERIFY: _lora_action,
        Step.LORA_LOAD: _lora_action,
        Step.LORA_UNLOAD: _lora_action,
    }

    def _sync_weights(self, refit: dict[str, Any]) -> bool:
        """At registration: load the fleet's current weights if ours differ. False (fatal) when that fails."""
        source, epoch = refit.get("source"), refit.get("epoch")
        if not isinstance(source, str) or not isinstance(epoch, int) or isinstance(epoch, bool):
            logger.warning("ignoring a malformed refit instruction in HELLO_ACK: %r", refit)
            return True
        if source == self.weights_source and epoch == self.engine.epoch:
            return True
        peer = refit.get("peer")  # weights a trainer sent: from a live engine of our layout
        logger.info("the fleet serves epoch %d from %s: loading it before serving%s", epoch, source,
                    f" from engine {peer.get('engine_id')}" if isinstance(peer, dict) else "")
        try:
            if isinstance(peer, dict):
                from ..weights.peer_pull import PeerSource  # noqa: PLC0415 - torch only where an engine lives

                timings = self.engine.memory.refit(PeerSource(str(peer["address"]), str(peer["prefix"]), epoch,
                                                       float(peer["timeout_s"]), source), epoch)
            else:
                timings = self.engine.memory.refit(source, epoch)
        except Exception as exc:  # noqa: BLE001
            self.fatal = (f"cannot load the fleet's current weights (epoch {epoch}) from {source}: {exc} "
                          "(start this engine with a model of the fleet's architecture)")
            return False
        self.weights_source = source
        self._note_weights()
        logger.info("loaded epoch %d in %.2fs", epoch, timings["total_s"])
        return True

    def _sync_loras(self, loras: dict[str, str]) -> None:
        """At registration: load the LoRA adapters the fleet was told to serve while this engine was away (the
        names it serves already are kept). One it cannot load is logged and left out: the coordinator routes
        that adapter's requests to the engines serving it."""
        adapters = self.engine.adapters
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
        self.link.hello["info"]["loras"] = adapters.names()

    def _begin_drain(self, timeout: float, why: str) -> None:
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + max(0.0, timeout)
            load = self.engine.load()
            logger.info("%s: draining (%d running, %d waiting; up to %.0fs)", why, load.running, load.waiting,
                        timeout)
            self._send(Header.DRAINING, {"engine_id": self.engine_id})
            self._publish_stats(force=True)

    def _drain_finished(self) -> bool:
        """Hand back what is left once done, timed out, or unable to step; True when we may exit."""
        stepping = self.state is FleetState.RUNNING
        if self.engine.has_unfinished_requests() and stepping and time.monotonic() < self.drain_deadline:
            return False
        self._step(settle=True)
        rest = self.engine.take_unfinished_requests()
        ids = [r.request_id for r in rest]
        if not self.session:
            logger.info("exiting without a coordinator (%d unfinished request(s) dropped)", len(ids))
            return True
        stopping = self.stop_control_id is not None
        self._handback_acked = False
        self._send(Header.HANDBACK, {"engine_id": self.engine_id, "request_ids": ids, "final": not stopping})
        deadline = time.monotonic() + _HANDBACK_ACK_WAIT
        while not self._handback_acked and time.monotonic() < deadline and not self.fatal:
            try:
                event = self.link.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if event[0] == "message" and event[1] is Header.HANDBACK:
                self._handback_acked = True
            elif event[0] == "registered":
                break  # a new coordinator: it never had these requests
        if stopping:
            self.state = FleetState.STOPPED
            self._ack(self.stop_control_id, {"handed_back": len(ids)})
        logger.info("drained: %d request(s) handed back%s; exiting", len(ids),
                    "" if self._handback_acked else " (no acknowledgement from the coordinator)")
        return True


def run_engine_process(
    make_engine: Callable[[], ServedEngine],
    address: str,
    **kwargs: Any,
) -> int:
    """Build the engine (slow: model load) and serve; the CLI entry point's body."""
    engine = make_engine()
    freeze_startup_heap()  # torch and the model: out of every later collection's walk (see heap)
    proc = EngineProcess(engine, address, **kwargs)
    proc.install_signal_handlers()
    try:
        return proc.run()
    finally:
        zmq.Context.instance().destroy(linger=2000)  # deliver queued frames before the process ends
