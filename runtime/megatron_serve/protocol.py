"""Wire protocol between the coordinator, engine processes and clients (DESIGN section 5).

Every message is ONE ZeroMQ frame holding a msgpack list ``[header, body]`` where ``header`` is
an integer :class:`Header` and ``body`` a map with string keys (``[header]`` alone means an empty
body). The coordinator binds a ROUTER; engines and clients connect DEALERs, so the ROUTER sees
``[peer identity, frame]``.

Everything a peer sends is untrusted: :func:`decode` checks size, msgpack syntax, the header and
the type of every known field, and raises :class:`ProtocolError` whose text says exactly what is
wrong, so that the receiver can log one useful line and drop the frame instead of crashing.
Unknown *extra* fields are accepted and ignored so that newer peers can talk to older ones.

Messages travel in two directions with different bodies (e.g. ``ABORT`` from a client names a
``client_request_id``; from the coordinator to an engine it names the engine-side
``request_id``), hence two schema tables: :data:`TO_COORDINATOR` and :data:`FROM_COORDINATOR`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import msgpack

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
    TOKENS = 11
    RESULT = 12
    ABORT = 13
    RESULT_ACK = 14  # client -> coordinator: these RESULTs arrived, forget them
    # lifecycle (client/control -> coordinator -> engines)
    PAUSE = 20
    UNPAUSE = 21
    SUSPEND = 22
    RESUME = 23
    STOP = 24
    CONTROL_ACK = 25
    REFIT = 26  # in-place weight refit (legal while PAUSED or SUSPENDED)
    # introspection and liveness
    STATUS = 30
    STATUS_REPLY = 31
    HEARTBEAT = 40
    DRAINING = 41
    # engine link (coordinator <-> engine processes only)
    ENGINE_SUBMIT = 50  # coordinator -> engine: serve this request record
    ENGINE_STEP = 51  # engine -> coordinator: the outputs of one engine step
    HANDBACK = 52  # engine -> coordinator: these requests are yours again (ack echoes it back)


#: The lifecycle verbs and the state each one aims for.
CONTROL_VERBS: dict[Header, str] = {
    Header.PAUSE: "PAUSED",
    Header.UNPAUSE: "RUNNING",
    Header.SUSPEND: "SUSPENDED",
    Header.RESUME: "PAUSED",
    Header.STOP: "STOPPED",
}


class FleetState(str, enum.Enum):
    """Lifecycle state of the coordinator (and of each engine, plus DRAINING for engines)."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    DRAINING = "DRAINING"


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


class ProtocolError(ValueError):
    """A frame that cannot be used; ``str(err)`` is the reason, ready for a log line."""


class Message(NamedTuple):
    header: Header
    body: dict[str, Any]


# ----------------------------------------------------------------------------- schemas

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_BOOL = (bool,)
_LIST = (list,)
_DICT = (dict,)
_ID = (str, int)  # ids from foreign clients may be ints; we always send str


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = True
    nullable: bool = False


def _req(*types: type) -> Field:
    return Field(tuple(types))


def _opt(*types: type) -> Field:
    return Field(tuple(types), required=False, nullable=True)


Schema = Mapping[str, Field]

_CONTROL: Schema = {"control_id": _req(*_ID)}

#: Bodies the coordinator accepts.
TO_COORDINATOR: dict[Header, Schema] = {
    Header.HELLO: {
        "role": _req(*_STR),
        "token": _opt(*_STR),
        "engine_group": _opt(*_INT),
        "capacity": _opt(*_INT),
        "client_id": _opt(*_STR),  # stable across reconnects, so results find the client again
        "acks": _opt(*_BOOL),  # the client sends RESULT_ACK; keep results until acknowledged
        "info": _opt(*_DICT),  # free-form facts about the peer (pid, host, kv pool size ...)
    },
    Header.SUBMIT: {
        "client_request_id": _req(*_ID),
        "prompt": _req(str, list),
        "sampling_params": _opt(*_DICT),
        "stream": _opt(*_BOOL),
        "generated_tokens": _opt(*_LIST),  # resubmission after a coordinator restart: continue
        # image files of a vision-language prompt: [{data: bin, offset?, length?}] (see multimodal.PromptImage)
        "images": _opt(*_LIST),
    },
    Header.ABORT: {"client_request_id": _req(*_ID)},
    Header.RESULT_ACK: {"client_request_ids": _req(*_LIST)},
    Header.PAUSE: _CONTROL,
    Header.UNPAUSE: _CONTROL,
    Header.SUSPEND: {**_CONTROL, "level": _opt(*_INT)},
    Header.RESUME: _CONTROL,
    Header.STOP: {**_CONTROL, "drain_timeout": _opt(*_NUM)},
    Header.REFIT: {**_CONTROL, "source": _req(*_STR), "epoch": _opt(*_INT)},
    Header.STATUS: {"status_id": _opt(*_ID)},
    Header.HEARTBEAT: {
        "engine_id": _opt(*_STR),
        "state": _opt(*_STR),
        "running": _opt(*_INT),
        "waiting": _opt(*_INT),
        "kv_blocks_free": _opt(*_INT),
        "kv_blocks_total": _opt(*_INT),
        "cached_tokens": _opt(*_INT),
        "computed_tokens": _opt(*_INT),
        "stats": _opt(*_DICT),
        # iterations of the engine's step loop; absent from older engines (unknown, never "stalled")
        "progress": _opt(*_INT),
        # cumulative engine counters and histogram buckets (engine_stats.EngineStats.to_wire); optional
        "metrics": _opt(*_DICT),
    },
    Header.DRAINING: {"engine_id": _opt(*_STR)},
    Header.CONTROL_ACK: {"control_id": _req(*_ID), "state": _req(*_STR), "detail": _opt(*_DICT),
                         "engine_id": _opt(*_STR)},
    Header.ENGINE_STEP: {"engine_id": _req(*_STR), "outputs": _req(*_LIST)},
    Header.HANDBACK: {"engine_id": _req(*_STR), "request_ids": _req(*_LIST), "final": _opt(*_BOOL)},
}

#: Bodies engines and clients accept from the coordinator.
FROM_COORDINATOR: dict[Header, Schema] = {
    Header.HELLO_ACK: {
        "coordinator_id": _req(*_STR),
        "state": _req(*_STR),
        "engine_id": _opt(*_STR),
        "engine_group": _opt(*_INT),
        "suspend_level": _opt(*_INT),
        "heartbeat_interval": _opt(*_NUM),
        "refit": _opt(*_DICT),  # {source, epoch}: the fleet's current weights, to load before serving
    },
    Header.ERROR: {
        "code": _req(*_STR),
        "message": _req(*_STR),
        "control_id": _opt(*_ID),
        "client_request_id": _opt(*_ID),
        "status_id": _opt(*_ID),
    },
    Header.TOKENS: {
        "client_request_id": _req(*_ID),
        "new_tokens": _req(*_LIST),
        "new_text": _opt(*_STR),
        "logprobs": _opt(*_LIST),
        "top_logprobs": _opt(*_LIST),  # per new token: [[token id, log prob], ...]
    },
    Header.RESULT: {"client_request_id": _req(*_ID), "request": _req(*_DICT)},
    Header.CONTROL_ACK: {"control_id": _req(*_ID), "state": _req(*_STR), "detail": _opt(*_DICT)},
    Header.STATUS_REPLY: {
        "state": _req(*_STR),
        "engines": _req(*_LIST),
        "queued": _req(*_INT),
        "in_flight": _req(*_INT),
        "completed": _req(*_INT),
        "failed": _req(*_INT),
        "aborted": _opt(*_INT),  # not counted in failed; absent from older coordinators
        "status_id": _opt(*_ID),
        "epoch": _opt(*_INT),  # generation of the weights the fleet serves (bumped by REFIT)
    },
    Header.HEARTBEAT: {"coordinator_id": _opt(*_STR), "state": _opt(*_STR)},
    # to engines
    Header.ENGINE_SUBMIT: {"request": _req(*_DICT)},
    Header.ABORT: {"request_id": _req(*_STR)},
    Header.PAUSE: _CONTROL,
    Header.UNPAUSE: _CONTROL,
    Header.SUSPEND: {**_CONTROL, "level": _opt(*_INT)},
    Header.RESUME: _CONTROL,
    Header.STOP: {**_CONTROL, "drain_timeout": _opt(*_NUM)},
    # phase "verify": check shapes only (every engine, before any loads); "load": load in place
    Header.REFIT: {**_CONTROL, "source": _req(*_STR), "epoch": _opt(*_INT), "phase": _opt(*_STR)},
    Header.HANDBACK: {"request_ids": _req(*_LIST)},
}

#: Fields of each item of ``ENGINE_STEP.outputs``.
STEP_OUTPUT_SCHEMA: Schema = {
    "request_id": _req(*_STR),
    "new_tokens": _req(*_LIST),
    "new_text": _opt(*_STR),
    "new_log_probs": _opt(*_LIST),
    "new_top_logprobs": _opt(*_LIST),  # per new token: [[token id, log prob], ...]
    "finished": _req(*_BOOL),
    "request": _opt(*_DICT),  # the full record, present when finished
}


# ----------------------------------------------------------------------------- encode / decode


def encode(header: Header, body: Mapping[str, Any] | None = None) -> bytes:
    """Pack one message. Raises ``ProtocolError`` if it would exceed :data:`MAX_MESSAGE_BYTES`."""
    frame = msgpack.packb([int(header), dict(body or {})], use_bin_type=True)
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{header.name} message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return frame


def _type_names(types: tuple[type, ...]) -> str:
    return "|".join(t.__name__ for t in types)


def check_fields(body: Mapping[str, Any], schema: Schema, what: str) -> None:
    """Raise ``ProtocolError`` naming the first missing or mistyped field of ``body``."""
    for name, spec in schema.items():
        if name not in body or body[name] is None:
            if spec.required:
                raise ProtocolError(f"{what}: missing field {name!r}")
            continue
        value = body[name]
        # bool is an int subclass; only accept it where bool is what we asked for.
        if isinstance(value, bool) and bool not in spec.types:
            raise ProtocolError(f"{what}: field {name!r} must be {_type_names(spec.types)}, got bool")
        if not isinstance(value, spec.types):
            raise ProtocolError(f"{what}: field {name!r} must be {_type_names(spec.types)}, got {type(value).__name__}")


def decode(
    frame: bytes,
    schemas: Mapping[Header, Schema],
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Message:
    """Parse and validate one frame against ``schemas`` (the table for this direction).

    Raises :class:`ProtocolError` with a one-line reason; never anything else.
    """
    size = len(frame)
    if size > max_bytes:
        raise ProtocolError(f"oversize frame: {size} bytes > limit {max_bytes}")
    if size == 0:
        raise ProtocolError("empty frame")
    try:
        obj = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except msgpack.ExtraData:
        raise ProtocolError("trailing bytes after the msgpack message") from None
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, UnpackValueError, FormatError, ...)
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(obj, list):
        raise ProtocolError(f"message must be a list [header, body], got {type(obj).__name__}")
    if not 1 <= len(obj) <= 2:
        raise ProtocolError(f"message must be [header] or [header, body], got a list of {len(obj)} items")
    raw_header = obj[0]
    if isinstance(raw_header, bool) or not isinstance(raw_header, int):
        raise ProtocolError(f"header must be an integer, got {type(raw_header).__name__}")
    try:
        header = Header(raw_header)
    except ValueError:
        raise ProtocolError(f"unknown header {raw_header}") from None
    schema = schemas.get(header)
    if schema is None:
        raise ProtocolError(f"header {header.name} is not accepted in this direction")
    body = obj[1] if len(obj) == 2 else {}
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ProtocolError(f"{header.name}: body must be a map, got {type(body).__name__}")
    for key in body:
        if not isinstance(key, str):
            raise ProtocolError(f"{header.name}: body keys must be strings, got {type(key).__name__}")
    check_fields(body, schema, header.name)
    return Message(header, body)


def int_list(value: Any, what: str) -> list[int]:
    """Validate a list of non-negative token ids (bool excluded)."""
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a list of token ids")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ProtocolError(f"{what} must hold non-negative integers, got {item!r}")
    return value
