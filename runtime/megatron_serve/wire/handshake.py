"""What peers say when they meet: the protocol version, HELLO, HELLO_ACK, ERROR and BATCH (docs/wire-protocol.md).

Protocol versions (``protocol`` in HELLO and HELLO_ACK; absent means 1): version 2 adds ``BATCH``,
one frame carrying several messages, which a peer sends only to a peer that announced 2. Version 3
adds PAUSE's ``mode`` and ``drain_timeout``: an older coordinator would ignore them (and keep), so a
client asks for a mode other than ``keep`` only of a coordinator that announced 3. Version 4 moves
the text out of engines and coordinator (see :class:`~megatron_serve.wire.deltas.TokenDelta`): engines send
token ids only and a final record without what their deltas carried; the coordinator sends ``TOKENS`` for every
request and ``RESULT`` records without the generated fields, so the client makes the text. A
coordinator refuses ``SUBMIT`` from a client below 4 (its results would have no text), and a
client refuses to submit to a coordinator below 4. Version 5 adds ``STEP_TOKENS``: one message per
engine step and client carrying every one of its requests' deltas (the engine's own bytes, forwarded
with a list of the client's request ids). Version 6 makes it the only token message: ``TOKENS`` (header 11,
a message per request) is retired, and a reconnected client's catch-ups travel as ``STEP_TOKENS`` with
``starts``. Peers submit to each other from 6 on (:data:`SUBMIT_PROTOCOL`): a client below 6 would drop the
catch-ups' ``starts`` and read them as new tokens, and a coordinator below 6 would send ``TOKENS`` this
client no longer reads; each refuses the other with a message naming both versions. Version 7 adds ``SUBMIT``'s
``placement``: a session and a data-parallel rank (:mod:`.placement` says what an older coordinator gets).
Version 8 moves a finished request's final record out of its ``ENGINE_STEP`` delta into the step's ``records``
(:class:`~megatron_serve.wire.deltas.EngineStep`), so that the coordinator forwards both as the engine's bytes; a
coordinator refuses an engine below 8 (:data:`ENGINE_PROTOCOL`) with a message naming both versions, since the
records it sent would go unread. Version 9 adds ``ENGINE_STEP``'s ``plain_ids``: the request ids of the step's
leading plain deltas, which the coordinator files and forwards without reading them; a coordinator reads every delta
of a step without them (an engine of 8), and an older coordinator ignores them. Version 10 adds ``SUBMIT``'s ``acks``:
the RESULTs a client acknowledges, carried by its next request instead of a ``RESULT_ACK`` message beside it; a client
puts them there only for a coordinator of 10 or later (:data:`SUBMIT_ACKS_PROTOCOL`), and sends ``RESULT_ACK`` to an
older one. Version 11 lets an engine build each client's share of a step: ``ENGINE_SUBMIT`` names the request's
client and its client request id (``client_id``, ``client_request_id``; only to an engine of 11, only for a request
whose deltas the coordinator need not read as they pass), and the engine sends those requests' deltas as ``ENGINE_STEP``'s
``shares``, one ``STEP_TOKENS`` message per client, which the coordinator forwards as they came after one check of
their ids (:class:`~megatron_serve.wire.deltas.ClientShare`). An engine of 10 gets no client and sends no shares.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .body import Body, ClientId

#: The protocol version this code speaks.
PROTOCOL_VERSION = 11
#: The oldest protocol a coordinator registers an engine of: 8 moved a finished request's record out of its last
#: delta (a record there would be lost), so an older engine is refused by name.
ENGINE_PROTOCOL = 8
#: The lowest version whose peers may submit to each other: from 6 on every token travels in ``STEP_TOKENS``
#: (and from 4 on the client makes the text).
SUBMIT_PROTOCOL = 6
#: The lowest coordinator version that reads the acknowledgements a ``SUBMIT`` carries (``acks``).
SUBMIT_ACKS_PROTOCOL = 10
#: The lowest engine version that builds its clients' shares of a step (told each request's client at dispatch).
SHARES_PROTOCOL = 11


class Hello(Body):
    role: str
    proof: str | None = None  # HMAC of the fleet secret and this connection's CURVE key (megatron_serve.wire.security)
    engine_group: Annotated[int, msgspec.Meta(ge=0)] | None = None
    capacity: int | None = None
    client_id: str | None = None  # stable across reconnects, so results find the client again
    acks: bool | None = None  # the client sends RESULT_ACK; keep results until acknowledged
    info: dict[str, Any] | None = None  # facts about the peer (pid, host, KV pool size, model, epoch ...)
    protocol: int = 1


class HelloAck(Body):
    coordinator_id: str
    state: str
    engine_id: str | None = None
    engine_group: int | None = None
    suspend_level: int | None = None
    heartbeat_interval: float | None = None
    refit: dict[str, Any] | None = None  # {source, epoch}: the fleet's current weights, to load before serving
    protocol: int = 1
    tokenizer: str | None = None  # to clients: the directory of the coordinator's tokenizer files
    loras: dict[str, str] | None = None  # to engines: LoRA adapters LOAD_LORA made the fleet serve, to load first
    # To engines: whether to send KV_EVENTS (the coordinator's routing reads them); an ack without it (an older
    # coordinator's) asks for them
    kv_events: bool = True


class Error(Body):
    code: str
    message: str
    control_id: ClientId | None = None
    client_request_id: ClientId | None = None
    status_id: ClientId | None = None
    detail: dict[str, Any] | None = None  # a refused verb's facts (e.g. each engine's weights after a failed REFIT)


class Batch(Body):
    """Several messages in one frame (protocol 2): each item is a whole ``[header, body]`` message."""

    messages: list[msgspec.Raw]
