"""Protocol 11: the engine builds each client's share of a step, and the coordinator forwards it unread.

At dispatch an engine of 11 is told a plain request's client and its client request id; it sends that request's
deltas in its client's share (a whole ``STEP_TOKENS`` message), which the coordinator forwards after one check of the
ids and keeps in the engine's log, read only when a mirror is (a move, a catch-up). A share that names a request the
engine does not hold for that client (aborted or moved meanwhile) is read delta by delta, as before.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from megatron_serve.coordinator import step_log
from megatron_serve.engine.output import shares_of
from megatron_serve.wire.handshake import SHARES_PROTOCOL
from megatron_serve.wire.messages import ClientAbort, EngineStep, EngineStepOut, Hello, RequestDelta, Submit
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

C, E1, E2 = b"client", b"engine-1", b"engine-2"


def submit(h: CoreHarness, crid: str, tokens: int = 8, **params: Any) -> None:
    raw = msgspec.msgpack.encode({"num_tokens_to_generate": tokens, **params})
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3], sampling_params=msgspec.Raw(raw),
                                    stream=True))


def routes_of(h: CoreHarness, identity: bytes) -> dict[str, tuple[str, Any]]:
    """What the engine at ``identity`` was told of its requests' clients (``ENGINE_SUBMIT``)."""
    return {s.request["request_id"]: (s.client_id, s.client_request_id) for s in h.take(identity, Header.ENGINE_SUBMIT)
            if s.client_id is not None}


def shared_step(h: CoreHarness, identity: bytes, engine_id: str, routes: dict[str, tuple[str, Any]],
                tokens: dict[str, list[int]], finished: tuple[str, ...] = ()) -> None:
    """An engine step whose deltas all travel in their clients' shares."""
    deltas = [RequestDelta(request_id=rid, new_tokens=ids, finished=rid in finished) for rid, ids in tokens.items()]
    records = {rid: {"request_id": rid, "status": "COMPLETED", "finish_reason": "length"} for rid in finished}
    body = EngineStepOut(engine_id=engine_id, outputs=[], records=records, shares=shares_of(deltas, routes))
    h.send(identity, Header.ENGINE_STEP, msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=EngineStep))


def streamed(h: CoreHarness) -> list[tuple[Any, list[int]]]:
    return [(d.client_request_id, d.new_tokens) for d in h.take(C, Header.STEP_TOKENS)]


def fleet() -> tuple[CoreHarness, str]:
    h = CoreHarness()
    h.client(C)
    return h, h.engine(E1, group=0)


def test_an_engine_is_told_the_client_of_plain_requests_only():
    h, _e1 = fleet()
    submit(h, "plain")
    submit(h, "scored", return_prompt_log_probs=True)
    submit(h, "kept", return_top_p_token_ids=True, top_p=0.5)
    submit(h, "tenant", tenant="t1")
    assert routes_of(h, E1) == {"c1/plain": ("c1", "plain")}


def test_an_engine_of_10_is_told_no_client():
    h = CoreHarness()
    h.client(C)
    h.send(E2, Header.HELLO, Hello(role="engine", engine_group=1, capacity=8, protocol=SHARES_PROTOCOL - 1))
    h.take(E2)
    submit(h, "a")
    assert [(s.request["request_id"], s.client_id) for s in h.take(E2, Header.ENGINE_SUBMIT)] == [("c1/a", None)]


def test_shares_are_forwarded_whole_mirrored_from_the_log_and_finished_after_their_tokens():
    h, e1 = fleet()
    submit(h, "a")
    submit(h, "b")
    routes = routes_of(h, E1)
    shared_step(h, E1, e1, routes, {"c1/a": [5], "c1/b": [6]})
    assert streamed(h) == [("a", [5]), ("b", [6])]
    shared_step(h, E1, e1, routes, {"c1/a": [7], "c1/b": [8]}, finished=("c1/b",))
    messages = h.take(C)
    assert [type(m).__name__ for m in messages] == ["ClientDelta", "ClientDelta", "Result"]
    assert messages[2].client_request_id == "b" and messages[2].request["status"] == "COMPLETED"
    table = h.core.flow.table
    assert table.get("c1/a").out.tokens == [5, 7] and table.get("c1/b").out.tokens == [6, 8]
    assert h.core.flow.stale_outputs == 0


def test_a_moved_request_goes_on_from_the_tokens_in_its_engines_log():
    h, e1 = fleet()
    submit(h, "a")
    routes = routes_of(h, E1)
    shared_step(h, E1, e1, routes, {"c1/a": [5]})
    shared_step(h, E1, e1, routes, {"c1/a": [6, 7]})
    h.engine(E2, group=1)
    h.gone.add(E1)
    h._perform(h.core.on_peer_gone(E1, "connection closed", h.now))
    moved = h.take(E2, Header.ENGINE_SUBMIT)
    assert [(m.request["generated_tokens"], m.client_id) for m in moved] == [([5, 6, 7], "c1")]


def test_a_share_naming_a_request_aborted_meanwhile_is_read_delta_by_delta():
    h, e1 = fleet()
    submit(h, "a")
    submit(h, "b")
    routes = routes_of(h, E1)
    h.send(C, Header.ABORT, ClientAbort(client_request_id="b"))
    h.take(C)
    shared_step(h, E1, e1, routes, {"c1/a": [5], "c1/b": [6]})
    assert streamed(h) == [("a", [5])]
    assert h.core.flow.stale_outputs == 1 and h.core.flow.table.get("c1/a").out.tokens == [5]


def test_a_share_for_another_client_is_not_forwarded_to_it():
    h, e1 = fleet()
    h.client(b"other", client_id="c2")
    submit(h, "a")
    routes = routes_of(h, E1)
    shared_step(h, E1, e1, {"c1/a": ("c2", "a")}, {"c1/a": [5]})  # named for c2: no request of c2's is held
    assert h.take(b"other", Header.STEP_TOKENS) == []
    assert streamed(h) == [("a", [5])]  # read one by one: it goes to its own client
    shared_step(h, E1, e1, routes, {"c1/a": [6]})
    assert streamed(h) == [("a", [6])] and h.core.flow.table.get("c1/a").out.tokens == [5, 6]


def test_a_full_log_files_the_older_half_into_the_requests_still_using_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(step_log, "LOG_LIMIT", 4)
    h, e1 = fleet()
    submit(h, "long", tokens=100)
    submit(h, "short", tokens=100)
    routes = routes_of(h, E1)
    shared_step(h, E1, e1, routes, {"c1/long": [1], "c1/short": [1]}, finished=("c1/short",))
    for token in range(2, 12):
        shared_step(h, E1, e1, routes, {"c1/long": [token]})
    log = h.core.members.engines[e1].log
    assert len(log.entries) < 4 and log.base > 0
    record = h.core.flow.table.get("c1/long")
    assert record.out.tokens == list(range(1, 12))


def test_a_resubmitting_client_catches_up_from_the_log():
    h, e1 = fleet()
    submit(h, "a")
    routes = routes_of(h, E1)
    shared_step(h, E1, e1, routes, {"c1/a": [5]})
    shared_step(h, E1, e1, routes, {"c1/a": [6]})
    h.take(C)
    raw = msgspec.msgpack.encode({"num_tokens_to_generate": 8})
    h.send(C, Header.SUBMIT, Submit(client_request_id="a", prompt=[1, 2, 3], sampling_params=msgspec.Raw(raw),
                                    generated_tokens=[5]))
    catch_up = h.take(C, Header.STEP_TOKENS)
    assert [(d.client_request_id, d.new_tokens, d.start) for d in catch_up] == [("a", [6], 1)]
