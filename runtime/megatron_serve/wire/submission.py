"""A request's way in and its final record's way out: SUBMIT, RESULT, ABORT and RESULT_ACK between client and
coordinator, ENGINE_SUBMIT, ABORT and HANDBACK between coordinator and engine (docs/wire-protocol.md).

The records themselves (``EngineRequest``, ``FinalRecord``) are :mod:`megatron_serve.wire.request`'s, which builds on
this module (a prompt's :class:`WireImage` travels in both); these bodies carry them as the bytes that arrived, so that
one a peer cannot read fails alone, by its id.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .body import Body, ClientId, TokenId
from .placement import Placement


class WireImage(msgspec.Struct, omit_defaults=True, kw_only=True):
    """An image file of a vision-language prompt (see ``multimodal.PromptImage``); ``offset`` and
    ``length`` say which run of placeholder tokens it fills once placed."""

    data: bytes
    offset: Annotated[int, msgspec.Meta(ge=0)] | None = None
    length: Annotated[int, msgspec.Meta(ge=0)] = 0


class Submit(Body):
    client_request_id: ClientId
    prompt: str | list[TokenId]
    # Decoded by the coordinator on its own, so that bad values are answered with an ERROR naming the request.
    sampling_params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET  # absent or nil: the defaults
    stream: bool | None = None
    generated_tokens: list[TokenId] | None = None  # resubmission after a coordinator restart: continue
    kept_ids: int | None = None  # with them: the kept ids (return_top_p_token_ids) they came with, still counted
    images: list[WireImage] | None = None  # one per image placeholder of the prompt, in order
    placement: Placement | None = None  # protocol 7: its session and data-parallel rank (wire.placement)
    # protocol 10: RESULTs that arrived (a RESULT_ACK's ids), riding here instead of in a message of their own
    acks: list[ClientId] | None = None


class Result(Body):
    """The final record of a request; the coordinator forwards the engine's record as it came (``Raw``).

    The record's ``request_id`` is the coordinator's key for the request (``<client id>/<client
    request id>``, the id engines know it by); the client's own id is ``client_request_id``.
    """

    client_request_id: ClientId
    request: msgspec.Raw  # ``wire.request.FinalRecord``, decoded by the client (one it cannot read fails alone)


class ResultOut(Body):
    """:class:`Result` as the coordinator writes it: the record is the engine's msgpack, spliced in unparsed."""

    client_request_id: ClientId
    request: msgspec.Raw


class ClientAbort(Body):
    client_request_id: ClientId


class ResultAck(Body):
    client_request_ids: list[ClientId]


class EngineSubmit(Body):
    """A request for an engine: ``wire.request.EngineRequest``, decoded by the engine on its own (so that one it
    cannot read fails alone, by its id)."""

    request: msgspec.Raw
    # vLLM's: {"do_remote_decode": true} to a prefill engine, {"do_remote_prefill": true, ...} to a decode engine
    # (after the request's KV_BLOCKS: wire.kv_blocks)
    kv_transfer_params: dict[str, Any] | None = None
    # protocol 11: the request's client and its id there, for the engine to send its plain deltas in that client's
    # share of each step (ENGINE_STEP's shares); absent, its deltas travel one by one
    client_id: str | None = None
    client_request_id: ClientId | None = None


class EngineSubmitOut(Body):
    """:class:`EngineSubmit` as the coordinator writes it (a ``wire.request.EngineRequestOut``)."""

    request: Any
    kv_transfer_params: dict[str, Any] | None = None
    client_id: str | None = None
    client_request_id: ClientId | None = None


class EngineAbort(Body):
    request_id: str


class Handback(Body):
    request_ids: list[Any]
    engine_id: str | None = None  # from engines; absent in the coordinator's acknowledgement
    final: bool | None = None
