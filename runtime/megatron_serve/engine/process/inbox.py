"""What the link thread queued for the engine process (:func:`handle_inbox`): a fatal refusal, a registration, or a
message of the current session from the coordinator, each handed to what acts on it between two steps."""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ...wire.submission import EngineSubmit
from ...wire.protocol import HEADER_VERBS, Header
from ...wire.request import EngineRequest, FinalRecord, FinishReason, RequestStatus
from ..group.turns import held
from ..output import ended_body
from .registration import on_registered
from .verb import on_verb

if TYPE_CHECKING:
    from .shell import Shell

logger = logging.getLogger("megatron_serve.engine_process")


class _Named(msgspec.Struct):
    request_id: str


_ENGINE_REQUEST = msgspec.msgpack.Decoder(EngineRequest)
_REQUEST_ID = msgspec.msgpack.Decoder(_Named)  # what names a request this engine cannot read


def handle_inbox(shell: Shell, timeout: float) -> None:
    """Everything queued now, waiting up to ``timeout`` for the first (0: not at all)."""
    inbox = shell.link.inbox
    try:
        event = inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
    except queue.Empty:
        return
    while True:
        kind = event[0]
        if kind == "fatal":
            shell.fatal = event[1]
            return
        if kind == "registered":
            on_registered(shell, event[1], event[2])
        elif kind == "message" and event[3] == shell.session:
            _on_coordinator(shell, event[1], event[2])
        try:
            event = inbox.get_nowait()
        except queue.Empty:
            return


def _on_coordinator(shell: Shell, header: Header, body: Any) -> None:
    engine = shell.engine
    if header is Header.ENGINE_SUBMIT:
        _add(shell, body)
    elif header is Header.KV_BLOCKS:
        engine.kv_in(body)
    elif header is Header.ABORT:
        shell.routes.pop(body.request_id, None)
        engine.abort_request(body.request_id)
    elif header is Header.HANDBACK:
        shell.handback_acked = True
    elif header in HEADER_VERBS and (verb := held(header, body)) is not None:
        shell.held = verb  # run() acts on it (engine.group.data_parallel)
    elif header in HEADER_VERBS:
        on_verb(shell, header, body)
    elif header is Header.PEER_WEIGHTS:  # a joiner of our layout pulls our weights, now, between two steps
        engine.memory.peers.share(body, engine.epoch)


def _add(shell: Shell, submit: EngineSubmit) -> None:
    """Serve a request handed over in ``ENGINE_SUBMIT``; one this engine cannot read fails at once. Its KV goes on
    after its first token when it asks so, or it starts on the blocks it brings (``kv_transfer_params``)."""
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
        shell.send(Header.ENGINE_STEP, ended_body(shell.engine_id, [failed]))
        return
    if submit.client_id is not None:  # protocol 11: its plain deltas go in that client's share of each step
        shell.routes[request.request_id] = (submit.client_id, submit.client_request_id)
    else:
        shell.routes.pop(request.request_id, None)
    shell.engine.add_request(request, submit.kv_transfer_params)
