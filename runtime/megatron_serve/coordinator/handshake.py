"""The handshake: HELLO proves the fleet secret; engines register a group, clients their id.

With a fleet secret, a HELLO counts only with the proof for the CURVE key of the connection it came
on (:mod:`megatron_serve.wire.security`); one without is dropped unanswered, and the connection stays
unknown: nothing it sends is acted on, nothing is sent to it. A client id belongs to the key that
first registered it: another key asking for it is refused (``unauthorized``), so a stolen client id
cannot collect that client's results or answers. An engine asking for a group that another live
engine holds is refused (``group_in_use``), after a probe of the holder: a holder whose connection
is gone (a restarted engine process) is removed first, and the new engine registers. The attention ranks
of one group under data-parallel attention (its HELLO's ``info`` says ``data_parallel_rank`` of
``data_parallel_size``) are engines of their own that share the group: each holds its rank of it.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any

from ..wire.lifecycle import FleetState
from ..wire.handshake import ENGINE_PROTOCOL, PROTOCOL_VERSION, SHARES_PROTOCOL, Error, Hello, HelloAck
from ..wire.rendezvous import RENDEZVOUS_SCHEME, PeerShare
from ..wire.protocol import ErrorCode, Header, Role
from .deadlines import Deadlines
from .droplog import DropLog
from .effects import Outbox
from .fleet_weights import FleetWeights
from .flow import RequestFlow
from .lifecycle import Lifecycle
from .liveness import Liveness
from .membership import Membership, RemoveEngine
from .peers import ClientRecord, EngineRecord
from .requests import Phase
from .step_tokens import catch_up

logger = logging.getLogger("megatron_serve.coordinator")

HEARTBEAT_INTERVAL = 1.0  # what engines are told to keep


class Handshake:
    """HELLOs and departures of connections (see the module docstring), over the fleet's members; a registering
    engine is brought to the fleet's lifecycle state and weights, a returning client gets what it missed from the
    request flow. ``remove_engine``: the core's removal of an engine whose connection is gone."""

    def __init__(self, *, members: Membership, lifecycle: Lifecycle, weights: FleetWeights, flow: RequestFlow,
                 liveness: Liveness, deadlines: Deadlines, outbox: Outbox, drop: DropLog,
                 remove_engine: RemoveEngine, kv_events: bool) -> None:
        """``kv_events``: whether engines are asked for their KV events (the routing policy reads them)."""
        self.members, self.lifecycle, self.weights, self.flow = members, lifecycle, weights, flow
        self.liveness, self.deadlines, self.outbox, self.drop = liveness, deadlines, outbox, drop
        self.remove_engine = remove_engine
        self.kv_events = kv_events

    def on_hello(self, identity: bytes, body: Hello, now: float, key: bytes | None = None,
                 probed: bool = False) -> None:
        """A HELLO on the connection ``identity``, whose CURVE key is ``key`` (``probed``: it waited for a probe
        of the group's holder, and was checked before)."""
        if self.members.secret is not None and not probed:
            if not self.members.secret.proves(body.proof, key):
                self.drop(self.members.peer_name(identity),
                          "HELLO without the proof of the fleet secret for its connection")
                self.members.proven.pop(identity, None)
                if identity in self.members.peers:
                    self.forget_peer(identity, "re-HELLO without the proof of the fleet secret", now)
                return
            self.members.proven[identity] = key
        try:
            role = Role(body.role)
        except ValueError:
            self.drop(self.members.peer_name(identity), f"HELLO with unknown role {body.role!r}")
            self.outbox.send(identity, Header.ERROR, Error(
                code=ErrorCode.INVALID_REQUEST.value, message=f"unknown role {body.role!r} (client, engine or control)"))
            return
        known = self.members.peers.get(identity)
        if known is not None:
            if known[0] is role:  # a retried HELLO on the same connection: answer it again
                self._ack_again(identity, known)
                return
            self.forget_peer(identity, "re-registered with another role", now)
        if role is Role.ENGINE:
            self._register_engine(identity, body, now, probed)
        else:
            self._register_client(identity, role, body, now, key)

    def _ack_again(self, identity: bytes, known: tuple[Role, str]) -> None:
        lifecycle = self.lifecycle
        ack = HelloAck(coordinator_id=lifecycle.coordinator_id, state=lifecycle.state.value, protocol=PROTOCOL_VERSION,
                       tokenizer=None if known[0] is Role.ENGINE else self.weights.tokenizer_dir)
        engine = self.members.engines.get(known[1]) if known[0] is Role.ENGINE else None
        if engine is not None:
            ack.engine_id, ack.engine_group, ack.suspend_level = engine.engine_id, engine.group, lifecycle.suspend_level
            ack.heartbeat_interval, ack.kv_events = HEARTBEAT_INTERVAL, self.kv_events
        self.outbox.send(identity, Header.HELLO_ACK, ack)

    def _register_engine(self, identity: bytes, body: Hello, now: float, probed: bool) -> None:
        if body.protocol < ENGINE_PROTOCOL:  # its final records would come inside its deltas, where none is read now
            message = (f"engine speaks wire protocol {body.protocol}; this coordinator needs {ENGINE_PROTOCOL} or "
                       f"later (an engine sends its finished requests' records beside the step's deltas): run engines "
                       f"of the coordinator's release")
            self.drop(self.members.peer_name(identity), message)
            self.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.UNSUPPORTED.value, message=message))
            return
        info = dict(body.info or {})
        rank = data_parallel_rank(info)
        if isinstance(rank, str):
            self.drop(self.members.peer_name(identity), rank)
            self.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.INVALID_REQUEST.value, message=rank))
            return
        group = body.engine_group
        in_use = {e.slot: e for e in self.members.engines.values()}
        if group is not None:
            holder = in_use.get((group, rank))
            if holder is not None and not probed:  # is the holder still there? ask, then look again
                self.outbox.probe(holder.identity, self.lifecycle.heartbeat(), (identity, body))
                return
            if holder is not None:
                held = f"engine group {group}" + (f" data-parallel rank {rank}" if "data_parallel_rank" in info else "")
                logger.warning("engine HELLO for %s refused: held by live engine %s", held, holder.engine_id)
                self.outbox.send(identity, Header.ERROR, Error(
                    code=ErrorCode.GROUP_IN_USE.value, message=f"{held} is held by live engine {holder.engine_id}"))
                return
        else:
            group = 0
            while (group, rank) in in_use:
                group += 1
        self.members.registrations += 1
        engine_id = f"e{self.members.registrations}-g{group}" + (f"-dp{rank}" if "data_parallel_rank" in info else "")
        blocks = info.get("kv_blocks_total")
        blocks = blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else 0
        engine = EngineRecord(engine_id=engine_id, identity=identity, group=group, capacity=max(1, body.capacity or 16),
                              info=info, kv_blocks_total=blocks, kv_blocks_free=blocks,
                              batches=body.protocol >= 2, shares=body.protocol >= SHARES_PROTOCOL, last_seen=now,
                              stall_clock=now)
        lifecycle = self.lifecycle
        engine.state = (FleetState.PAUSED if lifecycle.state is FleetState.STOPPED else lifecycle.state).value
        refit = self._weights_for(engine)
        self.members.engines[engine_id] = engine
        self.members.peers[identity] = (Role.ENGINE, engine_id)
        self.liveness.unresponsive.pop(identity, None)
        self.outbox.send(identity, Header.HELLO_ACK, HelloAck(
            coordinator_id=lifecycle.coordinator_id, state=lifecycle.state.value, engine_id=engine_id,
            engine_group=group, suspend_level=lifecycle.suspend_level, heartbeat_interval=HEARTBEAT_INTERVAL,
            refit=refit, protocol=PROTOCOL_VERSION, loras=dict(self.weights.loaded_loras) or None,
            kv_events=self.kv_events))
        logger.info("engine %s registered: group %d, capacity %d, adopts state %s%s", engine_id, group,
                    engine.capacity, lifecycle.state.value,
                    "".join(f", {k} {info[k]}" for k in ("host", "pid") if k in info))

    def _weights_for(self, engine: EngineRecord) -> dict[str, Any] | None:
        """At registration: the ``refit`` an engine must load before serving, if any.

        Weights a trainer sent cannot be reloaded from a directory: an engine that lacks them pulls them from a live
        engine of its layout when one has them (:func:`_pull_from_peer`); without one it is admitted but receives no
        requests (``FleetWeights.served_by``) until the next refit, which includes it.
        A coordinator that never refitted (e.g. it restarted) adopts the weights of the first
        registering engine of its model that reports a refit, so the fleet's epoch survives a
        coordinator restart; engines that then register with other weights load them.
        """
        epoch = engine.info.get("epoch")
        engine.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
        weights = engine.info.get("weights")
        engine.weights = weights if isinstance(weights, str) else None
        fleet = self.weights
        if not engine.same_model(fleet.model):
            return None
        if fleet.source is None:
            if engine.epoch > fleet.epoch and engine.weights is not None and \
                    all(e.epoch == fleet.epoch for e in self.members.engines.values() if e.same_model(fleet.model)):
                fleet.epoch, fleet.source = engine.epoch, engine.weights
                logger.info("adopted weights epoch %d (%s) from engine %s", fleet.epoch, fleet.source,
                            engine.engine_id)
            return None
        if engine.epoch == fleet.epoch and engine.weights == fleet.source:
            return None
        if fleet.source.startswith(RENDEZVOUS_SCHEME):
            peer = self._pull_from_peer(engine)
            if peer is not None:
                engine.epoch, engine.weights = fleet.epoch, fleet.source  # it exits if it cannot
                return {"source": fleet.source, "epoch": fleet.epoch, "peer": peer}
            logger.info("engine %s serves epoch %d; the fleet's epoch %d came from a trainer: it gets no requests "
                        "until the next refit includes it", engine.engine_id, engine.epoch, fleet.epoch)
            return None
        logger.info("engine %s serves epoch %d: it loads the fleet's epoch %d (%s) before serving",
                    engine.engine_id, engine.epoch, fleet.epoch, fleet.source)
        engine.epoch, engine.weights = fleet.epoch, fleet.source  # it exits if it cannot
        return {"source": fleet.source, "epoch": fleet.epoch}

    def _pull_from_peer(self, engine: EngineRecord) -> dict[str, Any] | None:
        """At registration after a trainer's refit: pick a donor for ``engine`` (a live engine of the same layout at
        the fleet's epoch with a peer store, the most recently heard first), tell it to send its weights, and return
        what the joiner's HELLO_ACK says of it (:mod:`megatron_serve.weights.peer_pull`); None when there is none. A
        group's ranks pull rank to rank, so a donor has as many ranks (tensor-parallel ranks times pipeline stages);
        each joiner rank checks its donor rank's layout before any byte moves."""
        layout = engine.info.get("weights_layout")
        if not isinstance(layout, str):
            return None
        fleet = self.weights
        donors = [e for e in self.members.engines.values()
                  if e.info.get("weights_layout") == layout and e.ranks == engine.ranks and e.peer_store is not None
                  and e.epoch == fleet.epoch and e.weights == fleet.source and not (e.draining or e.stopping)]
        if not donors:
            return None
        donor = max(donors, key=lambda e: e.last_seen)
        prefix = secrets.token_hex(16)  # this pull's keys: only these two (encrypted) messages carry it
        timeout = max(self.deadlines.verb, self.deadlines.weights)
        self.outbox.send(donor.identity, Header.PEER_WEIGHTS, PeerShare(engine_id=engine.engine_id, prefix=prefix,
                                                                        epoch=fleet.epoch, timeout_s=timeout))
        logger.info("engine %s pulls the fleet's epoch %d from engine %s", engine.engine_id, fleet.epoch,
                    donor.engine_id)
        return {"address": donor.peer_store, "prefix": prefix, "engine_id": donor.engine_id, "timeout_s": timeout}

    def _register_client(self, identity: bytes, role: Role, body: Hello, now: float,
                         key: bytes | None) -> None:
        client_id = body.client_id or uuid.uuid4().hex
        client = self.members.clients.get(client_id)
        if client is None:
            client = self.members.clients[client_id] = ClientRecord(client_id=client_id, role=role, identity=identity,
                                                                    acks=bool(body.acks), key=key)
        elif client.key != key:
            self.drop(self.members.peer_name(identity),
                      f"HELLO for client id {client_id[:8]}..., which another peer's key holds")
            self.outbox.send(identity, Header.ERROR, Error(code=ErrorCode.UNAUTHORIZED.value,
                                                           message="this client id belongs to another peer (its CURVE "
                                                                   "key): a client id cannot be taken over"))
            return
        else:
            if client.identity is not None and client.identity != identity:
                self.members.peers.pop(client.identity, None)
            client.identity, client.acks, client.offline_since = identity, bool(body.acks), None
        client.batches, client.protocol = body.protocol >= 2, body.protocol
        client.last_seen = now
        self.members.peers[identity] = (role, client_id)
        self.outbox.send(identity, Header.HELLO_ACK, HelloAck(
            coordinator_id=self.lifecycle.coordinator_id, state=self.lifecycle.state.value, protocol=PROTOCOL_VERSION,
            tokenizer=self.weights.tokenizer_dir))
        logger.debug("%s %s connected", role.value, client_id)
        # What the old connection may have lost, before anything else reaches the new one: every request's tokens
        # from the first (``start`` 0: the client keeps what lies past its own), so that the steps forwarded from
        # now on, which reach the client before its resubmission's catch-up, continue what it has; and the results
        # that finished while it was away, after their tokens (the client completes a result with the tokens it has).
        for key in list(client.requests):
            record = self.flow.table.get(key)
            if record is None:
                continue
            tokens = record.tokens_after(0)
            for message in catch_up(record.client_request_id, tokens, 0) if tokens is not None else ():
                self.outbox.send(identity, Header.STEP_TOKENS, message, client.batches)
            if record.phase is Phase.FINISHED:
                self.flow.deliver(record)
        # A verb that was in progress when the client lost its connection answers on the new one.

    def forget_peer(self, identity: bytes, reason: str, now: float) -> None:
        """A connection is gone: an engine leaves the fleet; a client goes offline (its requests stay)."""
        known = self.members.peers.pop(identity, None)
        if known is None:
            return
        role, who = known
        if role is Role.ENGINE:
            engine = self.members.engines.get(who)
            if engine is not None:
                self.remove_engine(engine, reason)
            return
        client = self.members.clients.get(who)
        if client is not None and client.identity == identity:
            client.identity, client.offline_since = None, now
            if not client.requests:
                del self.members.clients[who]


def data_parallel_rank(info: dict[str, Any]) -> int | str:
    """An engine's attention rank in its group from its HELLO's ``info`` (0 without data-parallel attention), or
    what is wrong with it."""
    if "data_parallel_rank" not in info and "data_parallel_size" not in info:
        return 0
    rank, size = info.get("data_parallel_rank"), info.get("data_parallel_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, size)) or not 0 <= rank < size:
        return (f"HELLO info: data_parallel_rank {rank!r} of data_parallel_size {size!r} is not a rank in [0, size) "
                "(both integers)")
    return rank
