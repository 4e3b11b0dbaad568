"""A quiet fleet's coordinator wakes and ticks a few times a second, one with requests waiting in its queue 20 times
(issue 84: the idle coordinator's CPU, and a serving one's ticks).

The loop's clock decides the deadlines (heartbeats, stalls, verb steps, a tenant's band as it waits); each tick and
each idle wake-up costs CPU whether anything is due or not. While nothing is under way that a tick decides soon
(``CoordinatorCore.quiet``: no request queued, no verb, no dropped frames to log) the period is a twentieth of the
shortest deadline a tick decides, up to 0.5 s; requests on engines and results not yet acknowledged leave the fleet
quiet. Real sockets: the coordinator's loop in a thread, a DEALER speaking the protocol as a client; the core's
``on_tick`` is wrapped only to note when it runs.
"""

from __future__ import annotations

import statistics
import threading
import time

import msgspec
import pytest
import zmq

from megatron_serve.coordinator import Coordinator, CoordinatorCore
from megatron_serve.coordinator.loop import quiet_tick
from megatron_serve.coordinator.requests import Phase
from megatron_serve.wire.messages import FROM_COORDINATOR, PROTOCOL_VERSION, EngineStep, Hello, RequestDelta, Submit
from megatron_serve.wire.protocol import Header, decode, encode

from .core_harness import CoreHarness

pytestmark = pytest.mark.timeout(60)


def gaps(ticks: list[float], count: int, after: float) -> list[float]:
    """The periods between the first ``count`` + 1 ticks from ``after`` on (polls until they came, 20 s at most)."""
    deadline = time.monotonic() + 20
    while len([t for t in ticks if t > after]) <= count:
        assert time.monotonic() < deadline, f"{len(ticks)} ticks"
        time.sleep(0.01)
    seen = [t for t in ticks if t > after][:count + 1]
    return [b - a for a, b in zip(seen, seen[1:])]


def test_the_quiet_period_follows_the_shortest_deadline_between_50_ms_and_half_a_second():
    assert quiet_tick(CoordinatorCore()) == 0.5  # heartbeat 10 s, stall 120 s, clients 600 s
    assert quiet_tick(CoordinatorCore(heartbeat_timeout=4.0)) == pytest.approx(0.2)
    assert quiet_tick(CoordinatorCore(stall_timeout=0.5)) == 0.05  # never below the busy period


def test_requests_on_engines_and_unacknowledged_results_leave_the_fleet_quiet_and_a_queued_one_does_not():
    h = CoreHarness(dispatch_factor=1.0)  # an engine holds its capacity and no more
    engine = h.engine(b"e1", capacity=1)
    h.client(b"c1")
    params = msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 1}))
    for crid in ("r1", "r2"):
        h.send(b"c1", Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3], sampling_params=params))
    table = h.core.flow.table
    assert (table.count(Phase.DISPATCHED), table.count(Phase.QUEUED)) == (1, 1)
    assert not h.core.quiet()  # r2 waits for room: a dispatch pass reads the clock

    on_engine = next(r for r in table if r.phase is Phase.DISPATCHED)
    h.send(b"e1", Header.ENGINE_STEP, EngineStep(engine_id=engine, outputs=[msgspec.Raw(msgspec.msgpack.encode(
        RequestDelta(request_id=on_engine.request_id, new_tokens=[7], finished=True)))]))
    assert (table.count(Phase.DISPATCHED), table.count(Phase.QUEUED), table.count(Phase.FINISHED)) == (1, 0, 1)
    assert h.core.quiet()  # r2 on the engine, r1's RESULT not yet acknowledged: nothing that a tick decides soon


def test_a_quiet_fleet_is_ticked_twice_a_second_and_one_with_a_request_twenty_times():
    coordinator = Coordinator(port=0, insecure=True)
    ticks: list[float] = []
    on_tick = coordinator.core.on_tick

    def noted(now: float) -> list:
        ticks.append(now)
        return on_tick(now)

    coordinator.core.on_tick = noted  # type: ignore[method-assign]
    address = coordinator.bind()
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        client.connect(address)
        assert min(gaps(ticks, 3, 0.0)) > 0.4  # quiet: nothing in the table, no verb

        client.send(encode(Header.HELLO, Hello(role="client", client_id="c", acks=True, protocol=PROTOCOL_VERSION)))
        assert client.poll(10_000) and decode(client.recv(), FROM_COORDINATOR).header is Header.HELLO_ACK
        submitted = time.monotonic()
        client.send(encode(Header.SUBMIT, Submit(client_request_id="r", prompt=[1, 2, 3], stream=True,
                                                 sampling_params=msgspec.Raw(msgspec.msgpack.encode(
                                                     {"num_tokens_to_generate": 4})))))
        # no engine: the request waits in the queue, and the clock runs at the busy period
        busy = gaps(ticks, 5, submitted + 0.6)  # past the quiet period the submission may have waited
        assert statistics.median(busy) < 0.2, busy  # (a loaded machine may hold one wake-up back: not the max)
        assert len(coordinator.core.flow.table) == 1
    finally:
        coordinator.shutdown()
        thread.join(10)
        client.close(linger=0)
