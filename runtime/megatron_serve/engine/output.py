"""What an engine step sends about each request: its new token ids and what was asked to go with them.

The step thread builds one struct per request here and nothing else: no text, no stop strings
(:mod:`megatron_serve.client.output_processor` makes those where the tokens are read), and the final
record leaves out what the deltas already carried. The engine process sends a step's structs as
one message (``ENGINE_STEP``), or several when prompt scores or kept ids make it large (:func:`step_bodies`), with the
final records of the requests that finished beside the deltas, never inside them: the coordinator forwards
both as these bytes (a delta to the client's ``STEP_TOKENS``, a record in ``RESULT``). Where the coordinator named a
request's client (protocol 11), the engine writes that client's ``STEP_TOKENS`` message itself (a share of the step),
and the coordinator forwards it whole. The in-process client hands the same structs to its event loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from ..wire.body import ClientId
from ..wire.expert_routing import routing_to_wire
from ..wire.deltas import ClientShare, EngineStepOut, RequestDelta, RoutingRows, is_plain, is_shared
from ..wire.protocol import Header
from ..wire.frame_cuts import FRAME_ENTRIES, delta_entries, runs
from ..wire.request import FinalRecord

if TYPE_CHECKING:
    from .steps import StepOutput


def step_messages(deltas: list[RequestDelta], limit: int = FRAME_ENTRIES) -> list[list[RequestDelta]]:
    """A step's deltas as the ``ENGINE_STEP`` messages that carry them, in order: one, unless prompt scores and kept
    ids pass ``limit`` entries, then cut before the delta that would pass it (:func:`~..wire.frame_cuts.runs`, the
    rule a catch-up is cut by too)."""
    if all(delta.prompt_scores is None and delta.top_p_token_ids is None for delta in deltas):
        return [deltas]
    return [deltas[run.start:run.stop] for run in runs([delta_entries(delta) for delta in deltas], limit)]


def step_delta(out: "StepOutput") -> RequestDelta:
    """One request's share of a step as it travels: the output's own fields (nothing the engine changes later)."""
    tokens = out.new_tokens
    delta = RequestDelta(request_id=out.request_id, new_tokens=tokens, finished=out.finished)
    if out.new_log_probs:
        delta.new_log_probs = out.new_log_probs
    if out.top_ids:
        delta.top_ids, delta.top_log_probs = out.top_ids, out.top_log_probs
    if out.top_p_token_ids:
        delta.top_p_token_ids = out.top_p_token_ids
    n = len(tokens)
    if n:
        policy, kv, lora = out.epochs
        delta.epochs = [[policy] * n, [kv] * n, [lora] * n]
    if out.new_routing is not None:
        start, rows = out.new_routing
        delta.routing = RoutingRows(start=start, **routing_to_wire(rows))
    if out.cached_tokens is not None:
        delta.cached_tokens = out.cached_tokens
        delta.prompt_scores = out.prompt_scores
    if out.stop_token:
        delta.stop_token = True
    return delta


#: Where a request's deltas go (protocol 11): request id -> its client's id and its client request id.
Routes = Mapping[str, tuple[str, ClientId]]


class _ShareBody(msgspec.Struct):
    client_request_ids: list[ClientId]
    deltas: list[RequestDelta]


class _ShareFrame(msgspec.Struct, array_like=True):
    """A ``STEP_TOKENS`` message as an engine writes it: ``[header, body]`` with the deltas as structs."""

    header: int
    body: _ShareBody


_ENCODE = msgspec.msgpack.Encoder()
_STEP_TOKENS = int(Header.STEP_TOKENS)


def step_bodies(engine_id: str, outputs: Sequence["StepOutput"], routes: Routes | None = None) -> list[EngineStepOut]:
    """A step's ``ENGINE_STEP`` bodies (:func:`step_messages`): each request's delta, and the final records of those
    that finished in the body of their delta. A delta of a request in ``routes`` that the coordinator need not read
    (:func:`~..wire.deltas.is_shared`) goes in its client's share (:func:`shares_of`); of the others, the plain deltas
    come first, their request ids beside them (``plain_ids``): the coordinator passes those on without reading them."""
    finals = {out.request_id: out.final for out in outputs if out.finished}
    bodies = []
    for deltas in step_messages([step_delta(out) for out in outputs]):
        records = {d.request_id: finals[d.request_id] for d in deltas if d.finished}
        shares: list[ClientShare] = []
        if routes:
            shared = [d for d in deltas if d.request_id in routes and is_shared(d)]
            if shared:
                shares = shares_of(shared, routes)
                if len(shared) < len(deltas):
                    ids = {d.request_id for d in shared}
                    deltas = [d for d in deltas if d.request_id not in ids]
                else:
                    deltas = []
        body = plain_first(engine_id, deltas, records)
        body.shares = shares
        bodies.append(body)
    return bodies


def shares_of(deltas: list[RequestDelta], routes: Routes) -> list[ClientShare]:
    """``deltas`` (each :func:`~..wire.deltas.is_shared`, each request's in ``routes``) as one ``STEP_TOKENS`` message
    per client, each named by its requests' ids (the coordinator checks them) and those that finished here."""
    by_client: dict[str, list[RequestDelta]] = {}
    for delta in deltas:
        by_client.setdefault(routes[delta.request_id][0], []).append(delta)
    return [ClientShare(client_id=client_id, request_ids=[d.request_id for d in part],
                        finished=[d.request_id for d in part if d.finished],
                        frame=_ENCODE.encode(_ShareFrame(_STEP_TOKENS, _ShareBody(
                            client_request_ids=[routes[d.request_id][1] for d in part], deltas=part))))
            for client_id, part in by_client.items()]


def plain_first(engine_id: str, deltas: list[RequestDelta], records: dict[str, FinalRecord | None]) -> EngineStepOut:
    """One ``ENGINE_STEP`` body: the plain deltas (:func:`~..wire.deltas.is_plain`) first, named in ``plain_ids``,
    then the others (a step's deltas are each another request's: their order says nothing)."""
    plain = [d for d in deltas if is_plain(d)]
    if len(plain) < len(deltas):
        deltas = plain + [d for d in deltas if not is_plain(d)]
    return EngineStepOut(engine_id=engine_id, outputs=deltas, records=records,
                         plain_ids=[d.request_id for d in plain])


def ended_body(engine_id: str, records: list[FinalRecord]) -> EngineStepOut:
    """The ``ENGINE_STEP`` of requests that end without a step's tokens (a failed step, an unreadable request): each
    an empty finished delta beside its record."""
    return EngineStepOut(engine_id=engine_id, records={r.request_id: r for r in records},
                         outputs=[RequestDelta(request_id=r.request_id, new_tokens=[], finished=True) for r in records])
