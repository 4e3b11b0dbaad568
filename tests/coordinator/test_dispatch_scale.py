"""Dispatch into a full fleet costs what changed, not a scan of every engine (issue 86, benchmarks/fleet_scale.py):
once a pass found no engine with room, a heartbeat or a SUBMIT looks at no engine, a step of one engine at that
engine, and an engine that registers at every engine again; every request still goes out as room appears."""

from __future__ import annotations

import msgspec

from megatron_serve.coordinator.peers import EngineRecord
from megatron_serve.wire.messages import EngineStep, Heartbeat, RequestDelta, Submit
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

C = b"client"


def submit(h: CoreHarness, crid: str) -> None:
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3], sampling_params=msgspec.Raw(
        msgspec.msgpack.encode({"num_tokens_to_generate": 4}))))


def finish(h: CoreHarness, identity: bytes, engine_id: str, request_ids: list[str]) -> None:
    outputs = [msgspec.Raw(msgspec.msgpack.encode(RequestDelta(request_id=rid, new_tokens=[7], finished=True)))
               for rid in request_ids]
    records = {rid: msgspec.Raw(msgspec.msgpack.encode({"request_id": rid, "status": "COMPLETED",
                                                        "finish_reason": "length"})) for rid in request_ids}
    h.send(identity, Header.ENGINE_STEP, EngineStep(engine_id=engine_id, outputs=outputs, records=records))


def sent_to(h: CoreHarness, identity: bytes) -> list[str]:
    return [body.request["request_id"] for body in h.take(identity, Header.ENGINE_SUBMIT)]


def test_a_full_fleet_is_looked_at_only_where_room_appears(monkeypatch):
    h = CoreHarness(dispatch_factor=1.0, heartbeat_timeout=1e6, stall_timeout=1e6)
    h.client(C)
    engines = {b"engine-%d" % i: h.engine(b"engine-%d" % i, group=i, capacity=2) for i in range(50)}
    for i in range(300):  # 100 fill the 50 engines, 200 wait
        submit(h, f"r{i}")
    held = {identity: sent_to(h, identity) for identity in engines}
    assert sum(map(len, held.values())) == 100
    looked: list[str] = []  # the engines whose room dispatch reads
    core = h.core
    monkeypatch.setattr(EngineRecord, "load", property(lambda engine: (looked.append(engine.engine_id),
                                                                       len(engine.assigned))[1]))

    submit(h, "late")  # into a full fleet
    h.send(b"engine-7", Header.HEARTBEAT, Heartbeat(running=2, waiting=0))
    assert looked == [] and not any(sent_to(h, identity) for identity in engines)

    finish(h, b"engine-7", engines[b"engine-7"], held[b"engine-7"])  # its room: two requests from the queue's head
    assert set(looked) == {engines[b"engine-7"]}
    assert [rid.split("/")[1] for rid in sent_to(h, b"engine-7")] == ["r100", "r101"]

    looked.clear()
    newcomer = h.engine(b"engine-new", group=99, capacity=2)  # a registration: every engine is looked at again
    assert len(set(looked)) == 51
    assert [rid.split("/")[1] for rid in sent_to(h, b"engine-new")] == ["r102", "r103"]
    assert newcomer in core.members.engines


def test_a_request_into_an_idle_fleet_is_placed_without_a_scan(monkeypatch):
    """least_loaded takes the least loaded engine off the candidates' heap: each SUBMIT into an idle fleet of 300
    engines reads the load of the one engine it goes to (filed again under its new load), not of all 300 (before:
    every engine, twice), and the requests still spread least-loaded first, ties to the smaller group."""
    h = CoreHarness(dispatch_factor=1.0, heartbeat_timeout=1e6, stall_timeout=1e6)
    h.client(C)
    engines = [h.engine(b"engine-%d" % i, group=i, capacity=2) for i in range(300)]
    submit(h, "first")  # the first pass after the registrations files every engine
    looked: list[str] = []
    monkeypatch.setattr(EngineRecord, "load", property(lambda engine: (looked.append(engine.engine_id),
                                                                       len(engine.assigned))[1]))
    placed = []
    for i in range(400):
        looked.clear()
        submit(h, f"r{i}")
        assert len(looked) <= 2, f"SUBMIT {i} read the load of {len(set(looked))} engines"
        placed.append(h.core.flow.table.get(f"c1/r{i}").engine_id)
    # engine 0 took "first"; then one request per engine in group order, then the second round
    assert placed[:299] == engines[1:300]
    assert placed[299:] == engines[:101]
