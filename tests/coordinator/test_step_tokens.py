"""``STEP_TOKENS``, the one token message (protocol 6): one message per engine step and client.

A client gets, per engine step, one message with its requests' ids and their deltas (an unfinished request's as
the engine encoded it; a finished one's without its record, which follows in ``RESULT``), each client its own.
The coordinator keeps its mirror of every request's tokens: a request whose engine is lost goes on from them, and a
client that reconnects gets what it missed, as a ``STEP_TOKENS`` with ``starts``. A client below 6 is refused at
``SUBMIT``. A ``STEP_TOKENS`` whose lists differ in length is refused where it enters; one over the frame limit goes
as several.
"""

from __future__ import annotations

import msgspec
import pytest

from megatron_serve.coordinator import step_tokens
from megatron_serve.wire.messages import (FROM_COORDINATOR, PROTOCOL_VERSION, EngineStep, Hello, RequestDelta, StepTokens,
                                          Submit)
from megatron_serve.coordinator.effects import Send
from megatron_serve.wire.protocol import Header, Message, ProtocolError, decode, encode, unbatch

from .core_harness import CoreHarness
from .test_core import C, E1, E2, submit

C2 = b"client-2"
SLIM = {"prompt_tokens": [1, 2, 3], "status": "COMPLETED", "finish_reason": "length"}


def out(request_id: str, tokens: list[int], finished: bool = False, **fields) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_tokens=tokens, finished=finished, **fields)


def step_body(engine_id: str, *outputs: RequestDelta) -> EngineStep:
    """An engine's step of ``outputs``, each finished one's record (SLIM) beside the deltas."""
    return EngineStep(engine_id=engine_id, outputs=[msgspec.Raw(msgspec.msgpack.encode(o)) for o in outputs],
                      records={o.request_id: msgspec.Raw(msgspec.msgpack.encode({"request_id": o.request_id, **SLIM}))
                               for o in outputs if o.finished})


def engine_step(h: CoreHarness, engine_id: str, *outputs: RequestDelta) -> None:
    h.send(E1, Header.ENGINE_STEP, step_body(engine_id, *outputs))


def streamed(crid: str, have: list[int] | None = None) -> Submit:
    return Submit(client_request_id=crid, prompt=[1, 2, 3], stream=True, generated_tokens=have,
                  sampling_params=msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 6})))


def received(h: CoreHarness, identity: bytes) -> list[tuple[Header, object]]:
    """What ``identity`` got, BATCHes opened, STEP_TOKENS left whole."""
    messages = []
    for message in h.inbox.pop(identity, []):
        messages += list(unbatch(message.body, FROM_COORDINATOR)) if message.header is Header.BATCH else [message]
    return [(m.header, m.body) for m in messages]


def fleet(client_protocol: int = PROTOCOL_VERSION) -> tuple[CoreHarness, str]:
    h = CoreHarness()
    h.send(C, Header.HELLO, Hello(role="client", client_id="c1", acks=True, protocol=client_protocol))
    h.take(C, Header.HELLO_ACK)
    return h, h.engine(E1, group=0)


def test_a_step_reaches_a_client_as_one_message_with_the_engines_deltas():
    h, e1 = fleet()
    h.client(C2, client_id="c2")
    for crid in ("a", "b", "c"):
        submit(h, crid, tokens=4, stream=True)
    h.send(C2, Header.SUBMIT, streamed("d"))
    h.take(E1)
    engine_step(h, e1, out("c1/a", [5], new_log_probs=[-0.5], top_ids=[[5, 9]], top_log_probs=[[-0.5, -1.0]]),
                       out("c1/b", [6]), out("c2/d", [8], epochs=[[1], [2]]), out("c1/c", [7]))
    mine = received(h, C)
    assert [header for header, _ in mine] == [Header.STEP_TOKENS]
    step = mine[0][1]
    assert step.client_request_ids == ["a", "b", "c"]
    assert [d.new_tokens for d in step.deltas] == [[5], [6], [7]]
    assert (step.deltas[0].new_log_probs, step.deltas[0].top_ids, step.deltas[0].top_log_probs) == (
        [-0.5], [[5, 9]], [[-0.5, -1.0]])
    theirs = received(h, C2)
    assert [(header, body.client_request_ids) for header, body in theirs] == [(Header.STEP_TOKENS, ["d"])]
    assert theirs[0][1].deltas[0].epochs == [[1], [2]]
    mirrored = h.core.flow.table
    assert mirrored.get("c1/a").generated_tokens == [5] and mirrored.get("c2/d").generated_tokens == [8]


def test_a_request_that_finishes_in_the_step_gets_its_last_tokens_in_the_step_before_its_result():
    h, e1 = fleet()
    submit(h, "a", tokens=2, stream=True)
    submit(h, "b", tokens=4, stream=True)
    h.take(E1)
    engine_step(h, e1, out("c1/a", [5]), out("c1/b", [6]))
    received(h, C)
    body = step_body(e1, out("c1/a", [7], finished=True), out("c1/b", [8]))
    frames = [effect.frame for effect in h.core.on_message(E1, Message(Header.ENGINE_STEP, body), h.now)
              if isinstance(effect, Send) and effect.identity == C]
    got = [msgspec.msgpack.decode(frame) for frame in frames]
    assert [header for header, _ in got] == [Header.STEP_TOKENS, Header.RESULT]
    step = got[0][1]
    assert step["client_request_ids"] == ["a", "b"] and [d["new_tokens"] for d in step["deltas"]] == [[7], [8]]
    assert "request" not in step["deltas"][0] and got[1][1]["client_request_id"] == "a"
    # forwarded as the engine's bytes, neither decoded nor encoded again: both deltas, and the record in RESULT
    assert all(bytes(raw) in frames[0] for raw in body.outputs) and bytes(body.records["c1/a"]) in frames[1]


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_client_below_protocol_6_is_refused_at_submit_naming_both_versions(protocol):
    h, _ = fleet(client_protocol=protocol)
    submit(h, "a", stream=True)
    [error] = h.take(C, Header.ERROR)
    assert error.code == "unsupported" and error.client_request_id == "a"
    assert f"speaks protocol {protocol}" in error.message and "clients of 6 or later" in error.message
    assert not h.take(E1, Header.ENGINE_SUBMIT)
    h.client(C2, client_id="c2")  # the control: a client of this protocol is served
    h.send(C2, Header.SUBMIT, streamed("b"))
    assert h.take(E1, Header.ENGINE_SUBMIT)


def test_the_mirror_behind_step_tokens_serves_a_reconnected_client_and_a_moved_request():
    h, e1 = fleet()
    h.send(C, Header.SUBMIT, streamed("a"))
    h.take(E1)
    engine_step(h, e1, out("c1/a", [5]))
    engine_step(h, e1, out("c1/a", [6, 7]))
    assert [header for header, _ in received(h, C)] == [Header.STEP_TOKENS, Header.STEP_TOKENS]
    h.send(C, Header.SUBMIT, streamed("a", have=[5]))  # the client reconnected with one of them
    [(header, missed)] = received(h, C)
    assert (header, missed.client_request_ids, missed.starts) == (Header.STEP_TOKENS, ["a"], [1])
    assert [d.new_tokens for d in missed.deltas] == [[6, 7]]
    h.core.on_peer_gone(E1, "lost", h.now)  # the engine is gone: the request goes on elsewhere from its tokens
    h.engine(E2, group=1)
    moved = h.take(E2, Header.ENGINE_SUBMIT)
    assert moved[-1].request["generated_tokens"] == [5, 6, 7]


def test_a_step_tokens_whose_lists_differ_in_length_is_refused():
    frame = encode(Header.STEP_TOKENS, {"client_request_ids": ["a", "b"], "deltas": [{"new_tokens": [5]}]})
    with pytest.raises(ProtocolError, match="2 client_request_ids for 1 deltas"):
        decode(frame, FROM_COORDINATOR)
    frame = encode(Header.STEP_TOKENS, {"client_request_ids": ["a"], "deltas": [{"new_tokens": [5]}], "starts": []})
    with pytest.raises(ProtocolError, match="0 starts for 1 deltas"):
        decode(frame, FROM_COORDINATOR)
    assert isinstance(decode(encode(Header.STEP_TOKENS, {"client_request_ids": ["a"], "deltas": [
        {"new_tokens": [5], "request_id": "c1/a", "finished": False}]}), FROM_COORDINATOR).body, StepTokens)


def test_a_step_tokens_over_the_size_limit_goes_as_several(monkeypatch):
    h, e1 = fleet()
    for crid in ("a", "b", "c"):
        submit(h, crid, stream=True)
    h.take(E1)
    monkeypatch.setattr(step_tokens, "MAX_MESSAGE_BYTES", 140)  # a whole step no longer fits; two requests' do
    engine_step(h, e1, out("c1/a", [5]), out("c1/b", [6]), out("c1/c", [7]))
    got = received(h, C)
    assert [(header, body.client_request_ids) for header, body in got] == [
        (Header.STEP_TOKENS, ["a", "b"]), (Header.STEP_TOKENS, ["c"])]
    assert [d.new_tokens for _, body in got for d in body.deltas] == [[5], [6], [7]]
