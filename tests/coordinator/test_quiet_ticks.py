"""A quiet fleet's coordinator wakes and ticks a few times a second, a busy one's 20 times (issue 84: the idle
coordinator's CPU).

The loop's clock decides the deadlines (heartbeats, stalls, verb steps, a tenant's band as it waits); each tick and
each idle wake-up costs CPU whether anything is due or not. While nothing is under way (``CoordinatorCore.quiet``) the
period is a twentieth of the shortest deadline a tick decides, up to 0.5 s. Real sockets: the coordinator's loop in a
thread, a DEALER speaking the protocol as a client; the core's ``on_tick`` is wrapped only to note when it runs.
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
from megatron_serve.wire.messages import FROM_COORDINATOR, PROTOCOL_VERSION, Hello, Submit
from megatron_serve.wire.protocol import Header, decode, encode

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
