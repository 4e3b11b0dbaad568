"""PAUSE's modes in the coordinator's core, without sockets: keep, wait (with its deadline), abort."""

from __future__ import annotations

from megatron_serve.wire.messages import FROM_COORDINATOR, Control, ControlAck, Pause, Suspend
from megatron_serve.wire.protocol import Header, unbatch

from .core_harness import CoreHarness
from .test_core import final_record, status, step, submit

C, E1 = b"client", b"engine-1"


def fleet(capacity: int = 1) -> tuple[CoreHarness, str, list[dict]]:
    """One client, one engine of ``capacity`` (it gets 2 * capacity requests), three requests: two on
    the engine, one queued at the coordinator."""
    h = CoreHarness(verb_timeout=5.0, heartbeat_timeout=1000.0)
    h.client(C)
    engine_id = h.engine(E1, capacity=capacity)
    for i in range(3):
        submit(h, f"r{i}", tokens=4)
    submitted = [b.request for b in h.take(E1, Header.ENGINE_SUBMIT)]
    assert [r["request_id"] for r in submitted] == ["c1/r0", "c1/r1"] and status(h).queued == 1
    return h, engine_id, submitted


def headers(h: CoreHarness, identity: bytes) -> list[tuple[Header, object]]:
    """What ``identity`` received since the last take, in order, with headers (BATCHes opened)."""
    out = []
    for message in h.inbox.pop(identity, []):
        items = unbatch(message.body, FROM_COORDINATOR) if message.header is Header.BATCH else [message]
        out += [(m.header, m.body) for m in items]
    return out


def ack_pause(h: CoreHarness, control_id: str = "p") -> ControlAck:
    """The engine acknowledges the PAUSE step (what it received of it is dropped); the client's answer."""
    h.take(E1, Header.PAUSE)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id=f"{control_id}#0", state="PAUSED"))
    return h.take(C, Header.CONTROL_ACK)[0]


def paused() -> CoreHarness:
    """:func:`fleet` paused by a PAUSE without a mode (``p``, acknowledged by the engine)."""
    h, _, _ = fleet()
    h.send(C, Header.PAUSE, Control(control_id="p"))
    ack_pause(h)
    return h


def test_keep_is_what_a_pause_without_a_mode_does_and_holds_every_request():
    h, _, _ = fleet()
    h.send(C, Header.PAUSE, Control(control_id="p"))  # an older client: no mode field at all
    assert [b.control_id for b in h.take(E1, Header.PAUSE)] == ["p#0"]
    ack = ack_pause(h)
    assert ack.detail["mode"] == "keep" and "aborted" not in ack.detail
    reply = status(h)
    assert (reply.in_flight, reply.queued, reply.aborted) == (2, 1, 0)  # kept on the engine, held here


def test_wait_lets_running_requests_finish_before_the_step_and_holds_queued_and_new_ones():
    h, e1, submitted = fleet()
    h.send(C, Header.PAUSE, Pause(control_id="p", mode="wait"))
    submit(h, "late", tokens=4)  # arrives while the fleet waits: queued, never dispatched
    assert not h.take(E1, Header.PAUSE) and not h.take(E1, Header.ENGINE_SUBMIT)
    step(h, E1, e1, "c1/r0", [5, 6, 7, 8], finished=True, record=final_record(submitted[0], [5, 6, 7, 8]))
    h.advance(1.0)
    assert not h.take(E1, Header.PAUSE) and not h.take(C, Header.CONTROL_ACK)  # r1 still runs
    step(h, E1, e1, "c1/r1", [9, 9, 9, 9], finished=True, record=final_record(submitted[1], [9, 9, 9, 9]))
    assert [b.control_id for b in h.take(E1, Header.PAUSE)] == ["p#0"]
    ack = ack_pause(h)
    assert ack.state == "PAUSED"
    assert {k: ack.detail[k] for k in ("mode", "unfinished", "timed_out")} == {
        "mode": "wait", "unfinished": 0, "timed_out": False}
    assert ack.detail["waited_s"] == 1.0
    results = {r.client_request_id: r.request for r in h.take(C, Header.RESULT)}
    assert sorted(results) == ["r0", "r1"] and all(r["finish_reason"] == "length" for r in results.values())
    assert (status(h).queued, status(h).in_flight) == (2, 0)
    h.send(C, Header.UNPAUSE, Control(control_id="u"))
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="u#0", state="RUNNING"))
    assert [b.request["request_id"] for b in h.take(E1, Header.ENGINE_SUBMIT)] == ["c1/r2", "c1/late"]


def test_wait_pauses_in_place_what_still_runs_at_its_deadline_and_says_so():
    h, e1, submitted = fleet()
    h.send(C, Header.PAUSE, Pause(control_id="p", mode="wait", drain_timeout=3.0))
    step(h, E1, e1, "c1/r0", [5, 6, 7, 8], finished=True, record=final_record(submitted[0], [5, 6, 7, 8]))
    h.advance(2.9)
    assert not h.take(E1, Header.PAUSE)
    h.advance(0.2)
    assert [b.control_id for b in h.take(E1, Header.PAUSE)] == ["p#0"]
    ack = ack_pause(h)
    assert (ack.detail["unfinished"], ack.detail["timed_out"]) == (1, True)
    assert status(h).in_flight == 1  # r1 is kept, as with mode keep: nothing is lost


def test_wait_while_already_paused_has_nothing_to_wait_for():
    h = paused()
    h.send(C, Header.PAUSE, Pause(control_id="p2", mode="wait"))
    assert [b.control_id for b in h.take(E1, Header.PAUSE)] == ["p2#0"]  # at once: paused engines never finish
    ack = ack_pause(h, "p2")
    assert ack.detail["noop"] and (ack.detail["unfinished"], ack.detail["timed_out"]) == (2, False)


def test_abort_ends_running_and_queued_requests_with_their_tokens_before_the_engines_pause():
    h, e1, _ = fleet()
    step(h, E1, e1, "c1/r0", [5, 6])  # two tokens so far
    h.send(C, Header.PAUSE, Pause(control_id="p", mode="abort"))
    sent = headers(h, E1)
    assert [(hd, getattr(b, "request_id", getattr(b, "control_id", None))) for hd, b in sent] == [
        (Header.ABORT, "c1/r0"), (Header.ABORT, "c1/r1"), (Header.PAUSE, "p#0")]  # drops first, then the step
    results = {r.client_request_id: r.request for r in h.take(C, Header.RESULT)}
    assert sorted(results) == ["r0", "r1", "r2"]
    assert {k: (r["status"], r["finish_reason"]) for k, r in results.items()} == {
        "r0": ("COMPLETED", "abort"), "r1": ("COMPLETED", "abort"), "r2": ("COMPLETED", "abort")}
    assert [t.new_tokens for t in h.take(C, Header.STEP_TOKENS)] == [[5, 6]]  # r0's tokens went before its record
    assert results["r0"]["error"] is None and results["r0"]["events"][-1]["type"] == "FINISH"
    step(h, E1, e1, "c1/r0", [7])  # the engine's step that crossed the ABORT: never delivered
    assert not h.take(C, Header.STEP_TOKENS) and not h.take(C, Header.RESULT)
    ack = ack_pause(h)
    assert (ack.detail["mode"], ack.detail["aborted"]) == ("abort", 3)
    reply = status(h)
    assert (reply.queued, reply.in_flight, reply.aborted, reply.failed, reply.completed) == (0, 0, 3, 0, 0)
    submit(h, "after", tokens=4)  # arrives while paused: held for UNPAUSE, not aborted
    assert status(h).queued == 1 and not h.take(C, Header.RESULT)


def test_abort_while_paused_ends_what_keep_held():
    h = paused()
    h.send(C, Header.PAUSE, Pause(control_id="p2", mode="abort"))
    assert [hd for hd, _ in headers(h, E1)] == [Header.ABORT, Header.ABORT, Header.PAUSE]
    assert ack_pause(h, "p2").detail["aborted"] == 3
    assert (status(h).in_flight, status(h).queued) == (0, 0)


def test_bad_modes_and_drain_times_are_refused_naming_the_field_and_change_nothing():
    h, _, _ = fleet()
    for control_id, body, named in [
        ("a", Pause(control_id="a", mode="sleep"), "mode must be one of keep, wait, abort; got 'sleep'"),
        ("b", Pause(control_id="b", mode="keep", drain_timeout=5.0), "drain_timeout applies to mode wait only"),
        ("c", Pause(control_id="c", mode="wait", drain_timeout=-1.0), "drain_timeout must be a number of seconds"),
        ("d", Pause(control_id="d", mode="wait", drain_timeout=float("nan")), "drain_timeout must be a number"),
    ]:
        h.send(C, Header.PAUSE, body)
        error = h.take(C, Header.ERROR)[0]
        assert (error.code, error.control_id) == ("invalid_request", control_id) and named in error.message
    assert status(h).state == "RUNNING" and not h.take(E1, Header.PAUSE)
    h.send(C, Header.PAUSE, Pause(control_id="e", mode="ABORT"))  # case does not matter, as for verbs
    assert ack_pause(h, "e").detail["mode"] == "abort"


def test_suspend_from_running_pauses_in_keep_mode():
    h, _, _ = fleet()
    h.send(C, Header.SUSPEND, Suspend(control_id="s"))
    assert [b.control_id for b in h.take(E1, Header.PAUSE)] == ["s#0"] and status(h).in_flight == 2


def test_abort_while_suspended_ends_what_the_fleet_holds_without_an_engine_step():
    h, _, _ = fleet()
    h.send(C, Header.SUSPEND, Suspend(control_id="s"))
    h.take(E1, Header.PAUSE)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#0", state="PAUSED"))
    h.take(E1, Header.SUSPEND)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#1", state="SUSPENDED"))
    assert h.take(C, Header.CONTROL_ACK)[0].state == "SUSPENDED"
    h.send(C, Header.PAUSE, Pause(control_id="p", mode="abort"))
    assert [hd for hd, _ in headers(h, E1)] == [Header.ABORT, Header.ABORT]  # no PAUSE step while suspended
    ack = h.take(C, Header.CONTROL_ACK)[0]
    assert (ack.state, ack.detail["aborted"]) == ("SUSPENDED", 3)
    assert len(h.take(C, Header.RESULT)) == 3 and (status(h).in_flight, status(h).queued) == (0, 0)


def test_suspend_keep_kv_reaches_every_engine_s_suspend_step():
    h, _, _ = fleet()
    h.send(C, Header.SUSPEND, Suspend(control_id="s", level=1, keep_kv=True))
    h.take(E1, Header.PAUSE)
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#0", state="PAUSED"))
    [step_body] = h.take(E1, Header.SUSPEND)
    assert (step_body.control_id, step_body.level, step_body.keep_kv) == ("s#1", 1, True)
    h.send(C, Header.SUSPEND, Suspend(control_id="t"))  # without it: the engines are told nothing of keeping
    h.send(E1, Header.CONTROL_ACK, ControlAck(control_id="s#1", state="SUSPENDED"))
    [plain] = h.take(E1, Header.SUSPEND)
    assert plain.keep_kv is None
