"""Wire protocol between the coordinator, engine processes and clients (docs/wire-protocol.md): frames.

Every message is ONE ZeroMQ frame holding a msgpack list ``[header, body]`` where ``header`` is
an integer :class:`Header` and ``body`` a map with string keys (``[header]`` alone means an empty
body). The coordinator binds a ROUTER; engines and clients connect DEALERs, so the ROUTER sees
``[peer identity, frame]``. The bodies are typed structs (:mod:`megatron_serve.wire.messages`).

Everything a peer sends is untrusted: :func:`decode` checks size, msgpack syntax, the header and
the type of every known field of the body in one pass, and raises :class:`ProtocolError` whose text
says exactly what is wrong, so that the receiver can log one useful line and drop the frame
instead of crashing. Unknown *extra* fields are ignored so that newer peers can talk to older ones.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Iterator, Mapping, NamedTuple, Union

import msgspec

from .lifecycle import PHASED_VERBS, STEPS, Step, Verb

if TYPE_CHECKING:
    from .body import Body
    from .handshake import Batch

#: Default largest frame accepted (and sent). Prompts of a million tokens fit easily.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

DEFAULT_PORT = 5555


class Header(enum.IntEnum):
    """First item of every frame. Values are part of the public contract: never renumber."""

    # handshake
    HELLO = 1
    HELLO_ACK = 2
    ERROR = 3
    # requests (client <-> coordinator)
    SUBMIT = 10
    # 11 was TOKENS (a request's new tokens, protocols 1-5): retired in 6, where STEP_TOKENS carries every delta.
    RESULT = 12
    ABORT = 13
    RESULT_ACK = 14  # client -> coordinator: these RESULTs arrived, forget them
    BATCH = 15  # protocol 2: several messages in one frame (either direction)
    STEP_TOKENS = 16  # coordinator -> client: a step's deltas of a client's requests (or catch-ups)
    # lifecycle (client/control -> coordinator -> engines)
    PAUSE = 20
    UNPAUSE = 21
    SUSPEND = 22
    RESUME = 23
    STOP = 24
    CONTROL_ACK = 25
    REFIT = 26  # in-place weight refit (legal while PAUSED or SUSPENDED)
    LOAD_LORA = 27  # serve a LoRA adapter (phase verify, then load)
    UNLOAD_LORA = 28  # stop serving a LoRA adapter
    RESET_PREFIX_CACHE = 29  # forget every cached prefix block in every KV tier
    # introspection and liveness
    STATUS = 30
    STATUS_REPLY = 31
    SCALE_EP = 32  # an expert-parallel group of data-parallel attention ranks to N ranks (a lifecycle verb)
    STATUS_DETAIL = 33  # every engine's facts, asked of it between two steps (a lifecycle verb that changes nothing)
    HEARTBEAT = 40
    DRAINING = 41
    # engine link (coordinator <-> engine processes only)
    ENGINE_SUBMIT = 50  # coordinator -> engine: serve this request record
    ENGINE_STEP = 51  # engine -> coordinator: the outputs of one engine step
    HANDBACK = 52  # engine -> coordinator: these requests are yours again (ack echoes it back)
    KV_BLOCKS = 53  # prefill engine -> coordinator -> decode engine: a prefilled request's KV blocks (a part)
    PEER_WEIGHTS = 54  # coordinator -> engine: send your weights to a joiner of your layout (weights.peer_pull)
    KV_EVENTS = 55  # engine -> coordinator: a numbered batch of the engine's KV events (wire.kv_events)


#: The message each lifecycle verb travels as: the header of its name (the verbs and their rules:
#: :mod:`megatron_serve.wire.lifecycle`; ``tests/client/test_verb_table.py`` checks that every verb has one).
VERB_HEADERS: dict[Verb, Header] = {verb: Header[verb.name] for verb in Verb}
HEADER_VERBS: dict[Header, Verb] = {header: verb for verb, header in VERB_HEADERS.items()}
_STEP_MESSAGES: dict[tuple[Header, str | None], Step] = {
    (VERB_HEADERS[spec.verb], spec.phase): step for step, spec in STEPS.items()}


def step_of(header: Header, phase: str | None) -> Step:
    """The lifecycle step a verb message from the coordinator carries (the ``phase`` of REFIT and LOAD_LORA
    tells which; coordinators older than REFIT's verify phase sent none: a load)."""
    if header is Header.REFIT and phase is None:
        return Step.REFIT_LOAD
    phased = header in HEADER_VERBS and HEADER_VERBS[header] in PHASED_VERBS
    step = _STEP_MESSAGES.get((header, phase if phased else None))
    if step is None:
        raise ProtocolError(f"{header.name}: unknown phase {phase!r}")
    return step


class Role(str, enum.Enum):
    CLIENT = "client"
    ENGINE = "engine"
    CONTROL = "control"


class ErrorCode(str, enum.Enum):
    """``code`` of an ``ERROR`` message; clients branch on it, humans read ``message``."""

    UNAUTHORIZED = "unauthorized"  # missing or wrong token
    HELLO_REQUIRED = "hello_required"  # peer unknown to this coordinator (e.g. it restarted)
    ILLEGAL_TRANSITION = "illegal_transition"  # lifecycle verb not allowed in the current state
    INVALID_REQUEST = "invalid_request"  # SUBMIT that can never run (bad params, empty prompt)
    GROUP_IN_USE = "group_in_use"  # another live engine holds that group id
    UNSUPPORTED = "unsupported"  # header known but not implemented by this peer
    REFIT_FAILED = "refit_failed"  # an engine could not verify or load the new weights
    FORBIDDEN = "forbidden"  # role may not send this header
    WEIGHTS_INCOMPLETE = "weights_incomplete"  # UNPAUSE while a failed refit left an engine with mixed weights
    CONTROL_ID_REUSED = "control_id_reused"  # a control id already used for another verb or other arguments
    LORA_REFUSED = "lora_refused"  # an engine refused a LoRA adapter (bad adapter, name taken); nothing changed
    LORA_NOT_FOUND = "lora_not_found"  # UNLOAD_LORA of an adapter no engine serves
    INVALID_PLACEMENT = "invalid_placement"  # SUBMIT pinned to a data-parallel rank no engine holds (protocol 7)


class ProtocolError(ValueError):
    """A frame that cannot be used; ``str(err)`` is the reason, ready for a log line."""


class Message(NamedTuple):
    header: Header
    body: "Body"


# ----------------------------------------------------------------------------- encode / decode

_ENCODER = msgspec.msgpack.Encoder()
_FRAME = msgspec.msgpack.Decoder(list[msgspec.Raw])
_HEADER = msgspec.msgpack.Decoder(int)
_EMPTY_MAP = b"\x80"
_NIL = b"\xc0"
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def encode(header: Header, body: "Body | Mapping[str, Any] | None" = None) -> bytes:
    """Pack one message. Raises ``ProtocolError`` if it would exceed :data:`MAX_MESSAGE_BYTES`."""
    frame = _ENCODER.encode((int(header), {} if body is None else body))
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{header.name} message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return frame


def encode_batch(frames: list[bytes]) -> bytes:
    """One ``BATCH`` frame holding already encoded messages (each spliced in as it is)."""
    return encode(Header.BATCH, {"messages": list(map(msgspec.Raw, frames))})


#: A BATCH frame is cut at about this size (well below :data:`MAX_MESSAGE_BYTES`).
BATCH_BYTES = 1 << 20


def pack_batches(frames: list[bytes]) -> list[bytes]:
    """``frames`` (encoded messages, in order) as BATCH frames of about :data:`BATCH_BYTES` each; a lone
    message goes as it is. Only for a peer that announced protocol 2."""
    if len(frames) < 2:
        return list(frames)
    if sum(map(len, frames)) <= BATCH_BYTES:  # an engine step's messages to one peer: one BATCH, no loop
        return [encode_batch(frames)]
    out, chunk, size = [], [], 0
    for frame in frames:
        if chunk and size + len(frame) > BATCH_BYTES:
            out.append(encode_batch(chunk) if len(chunk) > 1 else chunk[0])
            chunk, size = [], 0
        chunk.append(frame)
        size += len(frame)
    if chunk:
        out.append(encode_batch(chunk) if len(chunk) > 1 else chunk[0])
    return out


def _decoder(body_type: type) -> msgspec.msgpack.Decoder:
    decoder = _DECODERS.get(body_type)
    if decoder is None:
        decoder = _DECODERS[body_type] = msgspec.msgpack.Decoder(body_type)
    return decoder


#: id(table) -> (table, its one-call decoder, frame struct -> header). The table is held so that its id
#: cannot be reused by another table (tests decode with tables of their own).
_FAST: dict[int, tuple[Mapping[Header, type], msgspec.msgpack.Decoder, dict[type, Header]]] = {}


def _fast_decoder(table: Mapping[Header, type]) -> tuple[msgspec.msgpack.Decoder, dict[type, Header]]:
    """One decoder for a whole well-formed frame of ``table``: each ``[header, body]`` is a struct tagged
    by its header, so msgspec checks the list, the header and the body in one C call instead of three
    decodes and an enum lookup in Python (``benchmarks/coordinator_core.py`` measures the coordinator's
    cost per request; clients and engines read their frames the same way)."""
    fast = _FAST.get(id(table))
    if fast is None:
        frames = {msgspec.defstruct(f"{header.name.title()}Frame", [("body", body_type)], array_like=True,
                                    tag=int(header), forbid_unknown_fields=True): header
                  for header, body_type in table.items()}
        decoder = msgspec.msgpack.Decoder(Union[tuple(frames)])  # type: ignore[arg-type]
        fast = _FAST[id(table)] = (table, decoder, frames)
    return fast[1], fast[2]


#: id(table) -> (table, a decoder of a frame or of a BATCH of frames in one call, frame struct -> header).
_FAST_BATCH: dict[int, tuple[Mapping[Header, type], msgspec.msgpack.Decoder, dict[type, Header]]] = {}


def _fast_batch_decoder(table: Mapping[Header, type]) -> tuple[msgspec.msgpack.Decoder, dict[type, Header]]:
    """As :func:`_fast_decoder`, with a ``BATCH`` whose messages are typed too: one C call for a whole frame of an
    engine step's messages (a message per request in flight)."""
    fast = _FAST_BATCH.get(id(table))
    if fast is None:
        _single, frames = _fast_decoder(table)
        inner = {frame: header for frame, header in frames.items() if header is not Header.BATCH}
        messages = Union[tuple(inner)]  # type: ignore[valid-type]
        batch_body = msgspec.defstruct("TypedBatch", [("messages", list[messages])], forbid_unknown_fields=True)
        batch = msgspec.defstruct("TypedBatchFrame", [("body", batch_body)], array_like=True, tag=int(Header.BATCH),
                                  forbid_unknown_fields=True)
        decoder = msgspec.msgpack.Decoder(Union[(batch, *inner)])  # type: ignore[arg-type]
        fast = _FAST_BATCH[id(table)] = (table, decoder, {**inner, batch: Header.BATCH})
    return fast[1], fast[2]


def decode_all(frame: bytes | memoryview, table: Mapping[Header, type],
               max_bytes: int = MAX_MESSAGE_BYTES) -> list[Message | ProtocolError]:
    """The messages of one frame: the frame's own, or each of the ``BATCH`` it is, in order (an unreadable one
    as its ``ProtocolError``). Raises ``ProtocolError`` when the frame itself is unreadable.

    A well-formed frame is parsed in one call whatever it holds; a frame with a bad message is parsed again
    message by message, so that only that one is lost. Per message of a 64-message step frame this saves
    the Python around a :func:`decode` call.
    """
    if Header.BATCH in table and 0 < len(frame) <= max_bytes:
        decoder, headers = _fast_batch_decoder(table)
        try:
            whole = decoder.decode(frame)
        except (msgspec.DecodeError, RecursionError):
            pass  # the careful path says what is wrong
        else:
            header = headers[type(whole)]
            if header is not Header.BATCH:
                return [Message(header, whole.body)]
            return [Message(headers[type(item)], item.body) for item in whole.body.messages]
    message = decode(frame, table, max_bytes)
    return list(unbatch(message.body, table)) if message.header is Header.BATCH else [message]


def decode(frame: bytes | msgspec.Raw, table: Mapping[Header, type], max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate one frame against ``table`` (the bodies accepted in this direction,
    :data:`megatron_serve.wire.messages.TO_COORDINATOR` or ``FROM_COORDINATOR``).

    Raises :class:`ProtocolError` with a one-line reason; never anything else.
    """
    size = len(frame)
    if size > max_bytes:
        raise ProtocolError(f"oversize frame: {size} bytes > limit {max_bytes}")
    if size == 0:
        raise ProtocolError("empty frame")
    decoder, headers = _fast_decoder(table)
    try:
        whole = decoder.decode(frame)
        return Message(headers[type(whole)], whole.body)
    except (msgspec.DecodeError, RecursionError):
        pass  # not well-formed: the checks below say exactly what is wrong ([header] and nil bodies pass)
    return _decode_checked(frame, table)


def _decode_checked(frame: bytes | msgspec.Raw, table: Mapping[Header, type]) -> Message:
    """:func:`decode` one step at a time, for a frame the one-call decoder refused: the reason names the part."""
    try:
        parts = _FRAME.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"message must be a list [header, body]: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not msgpack: {exc}"[:200]) from None
    except RecursionError:
        raise ProtocolError("not msgpack: nested too deeply") from None
    if not 1 <= len(parts) <= 2:
        raise ProtocolError(f"message must be [header] or [header, body], got a list of {len(parts)} items")
    try:
        raw_header = _HEADER.decode(parts[0])
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"header must be an integer: {exc}") from None
    try:
        header = Header(raw_header)
    except ValueError:
        raise ProtocolError(f"unknown header {raw_header}") from None
    body_type = table.get(header)
    if body_type is None:
        raise ProtocolError(f"header {header.name} is not accepted in this direction")
    body = parts[1] if len(parts) == 2 and not (len(parts[1]) == 1 and bytes(parts[1]) == _NIL) else _EMPTY_MAP
    try:
        return Message(header, _decoder(body_type).decode(body))
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{header.name}: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:  # a nested Raw field that does not parse
        raise ProtocolError(f"{header.name}: {exc or 'nested too deeply'}") from None


def unbatch(batch: "Batch", table: Mapping[Header, type]) -> Iterator[Message | ProtocolError]:
    """The messages of a ``BATCH`` in order; an unreadable one is yielded as its ``ProtocolError``."""
    for raw in batch.messages:
        try:
            message = decode(raw, table)
        except ProtocolError as exc:
            yield exc
            continue
        yield ProtocolError("BATCH inside a BATCH") if message.header is Header.BATCH else message
