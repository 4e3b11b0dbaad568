"""The coordinator's core without sockets: requests, engine loss, verb deadlines, refit, handshake."""

from __future__ import annotations

import msgspec

from megatron_serve.wire.messages import (ClientAbort, Control, ControlAck, EngineStep, Heartbeat, Refit, ResultAck,
                                     Status, RequestDelta, Submit, WireImage)
from megatron_serve.multimodal import PromptImage
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.protocol import ErrorCode, Header

from .core_harness import CoreHarness

C, E1, E2 = b"client", b"engine-1", b"engine-2"


def submit(h: CoreHarness, crid: str, tokens: int = 3, stream: bool = False, prompt: list[int] | None = None) -> None:
    params = msgspec.msgpack.encode({"num_tokens_to_generate": tokens})
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=prompt or [1, 2, 3],
                                    sampling_params=msgspec.Raw(params), stream=stream))


def step(h: CoreHarness, identity: bytes, engine_id: str, request_id: str, tokens: list[int], finished: bool = False,
         record: dict | None = None) -> None:
    out = RequestDelta(request_id=request_id, new_tokens=tokens, finished=finished)
    records = {} if record is None else {request_id: msgspec.Raw(msgspec.msgpack.encode(record))}
    h.send(identity, Header.ENGINE_STEP, EngineStep(engine_id=engine_id, records=records,
                                                    outputs=[msgspec.Raw(msgspec.msgpack.encode(out))]))


def final_record(submitted: dict, tokens: list[int]) -> dict:
    return {**submitted, "generated_tokens": tokens, "status": "COMPLETED", "finish_reason": "length",
            "generated_text": "t"}


def status(h: CoreHarness) -> msgspec.Struct:
    return h.core.status(Status(), h.now)


def test_requests_are_dispatched_finished_once_and_forgotten_on_ack():
    h = CoreHarness()
    h.client(C)
    e1 = h.engine(E1, group=0)
    for i in range(3):
        submit(h, f"r{i}")
    submitted = [b.request for b in h.take(E1, Header.ENGINE_SUBMIT)]
    assert [r["request_id"] for r in submitted] == ["c1/r0", "c1/r1", "c1/r2"]
    assert submitted[0]["sampling_params"] == {"num_tokens_to_generate": 3}  # the client's bytes, forwarded
    step(h, E1, e1, "c1/r0", [5, 6, 7], finished=True, record=final_record(submitted[0], [5, 6, 7]))
    step(h, E1, e1, "c1/r0", [8], finished=True, record=final_record(submitted[0], [8]))  # late duplicate
    results = h.take(C, Header.RESULT)
    assert len(results) == 1 and results[0].client_request_id == "r0"
    assert results[0].request["request_id"] == "c1/r0" and results[0].request["generated_tokens"] == [5, 6, 7]
    reply = status(h)
    assert (reply.completed, reply.in_flight, reply.queued) == (1, 2, 0) and h.core.flow.stale_outputs == 1
    h.send(C, Header.RESULT_ACK, ResultAck(client_request_ids=["r0"]))
    assert h.core.flow.table.get("c1/r0") is None and len(h.core.flow.table) == 2


def test_a_submit_carries_acknowledgements_which_are_read_before_its_request():
    """Protocol 10: ``SUBMIT``'s ``acks`` forget those results first, so a finished request's id may be used again at
    once for a new request (read after it, the submit would count as that finished one's resubmission)."""
    h = CoreHarness()
    h.client(C)
    e1 = h.engine(E1, group=0)
    submit(h, "r0")
    submitted = h.take(E1, Header.ENGINE_SUBMIT)[0].request
    step(h, E1, e1, "c1/r0", [5], finished=True, record=final_record(submitted, [5]))
    assert [r.client_request_id for r in h.take(C, Header.RESULT)] == ["r0"]
    params = msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 2}))
    h.send(C, Header.SUBMIT, Submit(client_request_id="r0", prompt=[4], sampling_params=params, acks=["r0", "r9"]))
    assert h.take(C, Header.RESULT) == []  # not delivered again: a new request
    again = h.take(E1, Header.ENGINE_SUBMIT)
    assert [(r.request["request_id"], r.request["prompt_tokens"]) for r in again] == [("c1/r0", [4])]
    assert len(h.core.flow.table) == 1


def test_a_lost_engine_hands_its_requests_to_another_which_continues_from_the_mirrored_tokens():
    h = CoreHarness()
    h.client(C)
    e1 = h.engine(E1, group=0, capacity=1)
    submit(h, "r", tokens=4, stream=True)
    assert h.take(E1, Header.ENGINE_SUBMIT)
    step(h, E1, e1, "c1/r", [11])
    step(h, E1, e1, "c1/r", [12])
    assert [t.new_tokens for t in h.take(C, Header.STEP_TOKENS)] == [[11], [12]]
    e2 = h.engine(E2, group=1, capacity=1)
    h.gone.add(E1)
    h.send(C, Header.STATUS, Status(status_id=1))  # any input; the probe of the closed connection:
    h._perform(h.core.on_peer_gone(E1, "connection closed", h.now))
    moved = h.take(E2, Header.ENGINE_SUBMIT)[0].request
    assert moved["generated_tokens"] == [11, 12] and moved["events"][-1]["type"] == "EVICT"
    step(h, E1, e1, "c1/r", [99], finished=True)  # the lost engine's output never counts
    step(h, E2, e2, "c1/r", [13])
    step(h, E2, e2, "c1/r", [14], finished=True, record=final_record(moved, [11, 12, 13, 14]))
    assert [t.new_tokens for t in h.take(C, Header.STEP_TOKENS)] == [[13], [14]]
    assert [r.request["generated_tokens"] for r in h.take(C, Header.RESULT)] == [[11, 12, 13, 14]]


def test_a_verb_step_that_an_engine_never_acknowledges_completes_without_it_after_its_deadline():
    h = CoreHarness(verb_timeout=5.0)
    h.client(C)
    e1, e2 = h.engine(E1, group=0), h.engine(E2, group=1)
    submit(h, "r")
    hung = E1 if h.take(E1, Header.ENGINE_SUBMIT) else E2
    hung_id, healthy, healthy_id = (e1, E2, e2) if hung == E1 else (e2, E1, e1)
    h.send(C, Header.PAUSE, Control(control_id="p"))
    assert [b.control_id for b in h.take(healthy, Header.PAUSE)] == ["p#0"]
    h.send(healthy, Header.CONTROL_ACK, ControlAck(control_id="p#0", state="PAUSED"))
    h.advance(4.0)
    assert not h.take(C, Header.CONTROL_ACK)  # still within the deadline
    h.send(hung, Header.HEARTBEAT, Heartbeat(engine_id=hung_id))  # its heartbeat thread lives on
    h.advance(2.0)
    ack = h.take(C, Header.CONTROL_ACK)[0]
    assert ack.state == "PAUSED" and ack.detail["unresponsive"] == [hung_id]
    assert "lost" in ack.detail["engines"][hung_id]
    assert [e["id"] for e in status(h).engines] == [healthy_id]
    assert status(h).queued == 1  # its request waits for the fleet to run again
    h.send(hung, Header.HEARTBEAT, Heartbeat(engine_id=hung_id))
    assert h.take(hung, Header.HEARTBEAT) and [e["id"] for e in status(h).engines] == [healthy_id]
    h.send(hung, Header.CONTROL_ACK, ControlAck(control_id="p#0", state="PAUSED"))  # its step loop is back
    assert h.take(hung, Header.ERROR)[0].code == "hello_required"
    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    h.send(healthy, Header.CONTROL_ACK, ControlAck(control_id="u#0", state="RUNNING"))
    assert h.take(healthy, Header.ENGINE_SUBMIT)[0].request["request_id"] == "c1/r"


def test_refit_verifies_everywhere_before_any_engine_loads_and_the_load_gets_the_weights_deadline():
    h = CoreHarness(verb_timeout=5.0, weights_timeout=100.0, heartbeat_timeout=1000.0)
    h.client(C)
    e1, e2 = h.engine(E1, group=0), h.engine(E2, group=1)
    h.send(C, Header.REFIT, Refit(control_id="early", source="/w1"))
    assert h.take(C, Header.ERROR)[0].code == "illegal_transition"  # RUNNING: PAUSE first
    h.send(C, Header.PAUSE, Control(control_id="p"))
    for peer in (E1, E2):
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="p#0", state="PAUSED"))
    h.take(C, Header.CONTROL_ACK)

    h.send(C, Header.REFIT, Refit(control_id="bad", source="/other-shapes"))
    assert [b.phase for b in h.take(E1, Header.REFIT)] == ["verify"]
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="bad#0", state="PAUSED", detail={"error": "shape"}))
    h.send(E2, Header.CONTROL_ACK, ControlAck(control_id="bad#0", state="PAUSED", detail={"verified_s": 0.1}))
    error = h.take(C, Header.ERROR)[0]
    assert error.code == "refit_failed" and e1 in error.message
    assert [b.phase for b in h.take(E2, Header.REFIT)] == ["verify"]  # and never a load
    assert h.core.weights.epoch == 0

    h.send(C, Header.REFIT, Refit(control_id="good", source="/w1"))
    for peer in (E1, E2):
        assert h.take(peer, Header.REFIT)[0].phase == "verify"
        h.send(peer, Header.CONTROL_ACK, ControlAck(control_id="good#0", state="PAUSED"))
    for peer in (E1, E2):
        load = h.take(peer, Header.REFIT)[0]
        assert (load.phase, load.epoch, load.source) == ("load", 1, "/w1")
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="good#1", state="PAUSED", detail={"load_s": 2.0}))
    h.advance(50.0)  # far beyond the verb deadline, within the weights deadline: E2 is still loading
    assert not h.take(C, Header.CONTROL_ACK) and len(status(h).engines) == 2
    h.send(E2, Header.CONTROL_ACK, ControlAck(control_id="good#1", state="PAUSED", detail={"load_s": 40.0}))
    ack = h.take(C, Header.CONTROL_ACK)[0]
    assert ack.detail["epoch"] == 1 and ack.detail["source"] == "/w1" and set(ack.detail["engines"]) == {e1, e2}
    assert status(h).epoch == 1 and status(h).epoch_mismatch == []


def test_illegal_transitions_are_refused_by_the_table_and_noops_still_acknowledge():
    h = CoreHarness()
    h.client(C)
    h.engine(E1)
    h.send(C, Header.SUSPEND, Control(control_id="s"))  # from RUNNING: PAUSE then SUSPEND
    assert h.take(E1, Header.PAUSE)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#0", state="PAUSED"))
    assert h.take(E1, Header.SUSPEND)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#1", state="SUSPENDED"))
    assert h.take(C, Header.CONTROL_ACK)[0].state == "SUSPENDED"
    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    error = h.take(C, Header.ERROR)[0]
    assert error.code == "illegal_transition" and "RESUME first" in error.message
    h.send(C, Header.PAUSE, Control(control_id="p"))  # no engine step: already not stepping
    ack = h.take(C, Header.CONTROL_ACK)[0]
    assert ack.state == "SUSPENDED" and ack.detail["noop"] and not h.take(E1, Header.PAUSE)


def test_a_control_id_stands_for_one_verb_with_its_arguments():
    """A retry (same id, verb and arguments) is answered again; the same id for anything else is refused,
    naming the id and the verb it was used for, and nothing runs (an UNPAUSE that reused a PAUSE's id got
    the PAUSE's acknowledgement and the fleet stayed paused)."""
    from megatron_serve.wire.messages import Pause

    h = CoreHarness()
    h.client(C)
    h.engine(E1)
    h.send(C, Header.PAUSE, Pause(control_id="x", mode="wait"))
    h.send(C, Header.UNPAUSE, Control(control_id="x"))  # while the PAUSE waits for its engine
    refused = h.take(C, Header.ERROR)[0]
    assert refused.code == "control_id_reused" and refused.control_id == "x"
    assert "'x' was already used for PAUSE" in refused.message
    assert len(h.take(E1, Header.PAUSE)) == 1 and not h.take(E1, Header.UNPAUSE)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="x#0", state="PAUSED"))
    assert h.take(C, Header.CONTROL_ACK)[0].state == "PAUSED"
    h.send(C, Header.PAUSE, Pause(control_id="x", mode="wait"))  # a retry after a reconnect: the kept answer
    assert h.take(C, Header.CONTROL_ACK)[0].state == "PAUSED" and not h.take(E1)
    h.send(C, Header.PAUSE, Pause(control_id="x", mode="abort"))  # the same verb, other arguments
    assert "for a PAUSE with other arguments" in h.take(C, Header.ERROR)[0].message
    h.send(C, Header.UNPAUSE, Control(control_id="x"))
    assert h.take(C, Header.ERROR)[0].code == "control_id_reused" and not h.take(E1)
    assert status(h).state == "PAUSED"
    h.send(C, Header.UNPAUSE, Control(control_id="y"))
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="y#0", state="RUNNING"))
    assert h.take(C, Header.CONTROL_ACK)[0].state == "RUNNING" and status(h).state == "RUNNING"


def test_a_group_held_by_a_live_engine_is_refused_and_one_held_by_a_gone_engine_is_taken_over():
    h = CoreHarness()
    first = h.engine(E1, group=0)
    h.send(E2, Header.HELLO, msgspec.convert({"role": "engine", "engine_group": 0, "protocol": PROTOCOL_VERSION},
                                                 type=_hello()))
    assert h.take(E2, Header.ERROR)[0].code == "group_in_use"
    h.gone.add(E1)  # its process restarted: the probe finds the old connection gone
    second = h.engine(E2, group=0)
    assert second != first and [e["id"] for e in status(h).engines] == [second]


def test_a_probe_reaches_registered_peers_only():
    """The loop probes every connection on a closed one's file descriptor, and descriptors are reused:
    a refused peer's live connection may be named, and must be told nothing (it got a heartbeat)."""
    h = CoreHarness()
    h.engine(E1, group=0)
    h.send(E2, Header.HELLO, msgspec.convert({"role": "engine", "engine_group": 0, "protocol": PROTOCOL_VERSION},
                                                 type=_hello()))
    assert h.take(E2, Header.ERROR)[0].code == "group_in_use"
    h.core.probe(E2)
    h.core.probe(E1)
    assert [effect.identity for effect in h.core.on_tick(h.now)] == [E1]


def test_a_stalled_step_loop_loses_its_requests_while_a_slow_one_keeps_them():
    h = CoreHarness(stall_timeout=30.0)
    h.client(C)
    e1 = h.engine(E1, group=0)
    h.send(E1, Header.HEARTBEAT, Heartbeat(engine_id=e1, progress=1))
    submit(h, "r")
    for _ in range(4):  # heartbeats keep coming, the counter moves: slow, not stalled
        h.advance(10.0)
        h.send(E1, Header.HEARTBEAT, Heartbeat(engine_id=e1, progress=h.core.members.engines[e1].progress + 1))
    assert e1 in h.core.members.engines
    stuck = h.core.members.engines[e1].progress
    for _ in range(3):  # the counter stops
        h.advance(10.0)
        h.send(E1, Header.HEARTBEAT, Heartbeat(engine_id=e1, progress=stuck))
    assert e1 in h.core.members.engines  # 30 s: not yet
    h.advance(10.0)
    assert e1 not in h.core.members.engines and status(h).queued == 1


def test_an_aborted_request_is_answered_at_once_and_its_engine_told():
    h = CoreHarness()
    h.client(C)
    h.engine(E1)
    submit(h, "r")
    h.take(E1)
    h.send(C, Header.ABORT, ClientAbort(client_request_id="r"))
    assert h.take(E1, Header.ABORT)[0].request_id == "c1/r"
    result = h.take(C, Header.RESULT)[0].request
    assert (result["status"], result["finish_reason"]) == ("FAILED", "abort")


def _hello() -> type:
    from megatron_serve.wire.messages import Hello

    return Hello


def test_mirrored_tokens_keep_their_epochs_and_unknown_ones_are_minus_one():
    h = CoreHarness()
    h.client(C)
    e1 = h.engine(E1)
    submit(h, "r", tokens=5)
    h.take(E1)
    out = RequestDelta(request_id="c1/r", new_tokens=[4, 5], finished=False, epochs=[[3, 3], [2, 3]])
    h.send(E1, Header.ENGINE_STEP, EngineStep(engine_id=e1, outputs=[msgspec.Raw(msgspec.msgpack.encode(out))]))
    step(h, E1, e1, "c1/r", [6])  # an engine that does not report them
    record = h.core.flow.table.get("c1/r")
    assert record.out.policy_epochs == [3, 3, -1] and record.out.kv_epochs == [2, 3, -1]


def test_images_are_limited_must_arrive_placed_and_are_sent_with_every_dispatch_only():
    h = CoreHarness(max_image_bytes=10)
    h.client(C)
    e1 = h.engine(E1, group=0, capacity=1)
    h.send(C, Header.SUBMIT, Submit(client_request_id="big", prompt=[0, 5], images=[WireImage(data=b"x" * 11)]))
    message = h.take(C, Header.ERROR)[0].message
    assert "11 bytes" in message and "at most 10 bytes of images per request" in message
    h.send(C, Header.SUBMIT, Submit(client_request_id="mixed", prompt=[0, 0], images=[
        WireImage(data=b"a", offset=0, length=1), WireImage(data=b"b")]))
    assert "images[1] is not placed" in h.take(C, Header.ERROR)[0].message
    h.send(C, Header.SUBMIT, Submit(client_request_id="unplaced", prompt=[4, 0, 4], images=[WireImage(data=b"png")]))
    error = h.take(C, Header.ERROR)[0]
    assert error.code == ErrorCode.INVALID_REQUEST.value and error.client_request_id == "unplaced"
    assert "images[0] is not placed" in error.message and "loads none" in error.message

    h.send(C, Header.SUBMIT, Submit(client_request_id="r", prompt=[4, 0, 0, 4],
                                    images=[WireImage(data=b"png", offset=1, length=2)]))
    first = h.take(E1, Header.ENGINE_SUBMIT)[0].request
    assert first["prompt_tokens"] == [4, 0, 0, 4]
    assert first["images"] == [{"data": b"png", "offset": 1, "length": 2}]
    assert h.core.flow.table.get("c1/r").prefix_keys[1:3] == [PromptImage(b"png").cache_key] * 2

    step(h, E1, e1, "c1/r", [7])
    h.engine(E2, group=1, capacity=1)
    h.gone.add(E1)
    h._perform(h.core.on_peer_gone(E1, "connection closed", h.now))
    moved = h.take(E2, Header.ENGINE_SUBMIT)[0].request
    assert moved["images"] == first["images"] and moved["generated_tokens"] == [7]  # the move keeps them
    h.send(C, Header.ABORT, ClientAbort(client_request_id="r"))
    result = h.take(C, Header.RESULT)[0].request
    assert result["status"] == "FAILED" and "images" not in result  # results do not carry the files back
