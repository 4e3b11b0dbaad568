"""Engines send their KV events (``KV_EVENTS``, a frame per step that stores or drops a block) only to a coordinator
whose routing reads them (``kv_aware``): HELLO_ACK's ``kv_events`` says so, and an engine process attaches its link
to its KV event log, or not, by it. Under any other policy the coordinator would receive, decode and index them for
nothing (issue 84: the coordinator's CPU per streamed token)."""

from __future__ import annotations

import pytest

from megatron_serve.wire.handshake import PROTOCOL_VERSION, Hello, HelloAck
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.sampling_params import SamplingParams

from .core_harness import CoreHarness
from ..helpers import until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("routing, asked", [("least_loaded", False), ("round_robin", False),
                                            ("prefix_affinity", False), ("kv_aware", True)])
def test_hello_ack_asks_engines_for_kv_events_only_when_the_routing_reads_them(routing, asked):
    h = CoreHarness(routing=routing)
    hello = Hello(role="engine", engine_group=0, capacity=4, info={"kv_blocks_total": 64}, protocol=PROTOCOL_VERSION)
    h.send(b"engine", Header.HELLO, hello)
    assert h.take(b"engine", Header.HELLO_ACK)[-1].kv_events is asked
    h.send(b"engine", Header.HELLO, hello)  # the same connection's HELLO again: acknowledged again, alike
    assert h.take(b"engine", Header.HELLO_ACK)[-1].kv_events is asked


def test_an_ack_without_the_field_asks_for_kv_events():
    """An older coordinator's HELLO_ACK has no ``kv_events``: its engines send them, as they always did."""
    assert HelloAck(coordinator_id="c", state="running").kv_events is True


@pytest.mark.parametrize("routing, sent", [("least_loaded", False), ("kv_aware", True)])
async def test_an_engine_process_sends_kv_events_only_when_asked(fleet_factory, routing, sent):
    fleet = fleet_factory(routing=routing)
    proc, fake, _ = fleet.add_engine()
    async with fleet.connected(1) as client:
        result = await client.add_request([1, 2, 3], SamplingParams(temperature=0.0, num_tokens_to_generate=4))
        assert len(result.generated_tokens) == 4
        index = fleet.coordinator.core.dispatcher.kv_index
        if sent:  # a registration's first batch is the log's snapshot
            await until(lambda: index.batches >= 1, 10, "the engine's first KV_EVENTS batch")
        assert (proc.shell.send_kv_events in fake.kv_events.sinks) is sent
        assert (index.batches >= 1) is sent
