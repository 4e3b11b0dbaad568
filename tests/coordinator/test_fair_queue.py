"""The coordinator's policy for requests of tenants (docs/tenants.md), on its pure core with a fake clock and fake
engines: strict bands, weighted fair shares by tokens, room counted by band, starvation bounded by promotion, and
untenanted requests as before.

The fake engine here runs what it is sent first come first served, ``capacity`` at a time, one token per request
and step: whatever share a tenant gets is the coordinator's doing.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from megatron_serve.coordinator.fair_queue import FairQueue
from megatron_serve.coordinator.requests import Phase
from megatron_serve.wire.messages import EngineStep, RequestDelta, Submit
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.wire.tenancy import TenantTag

from .core_harness import CoreHarness

C, E1 = b"client", b"engine-1"


def submit(h: CoreHarness, crid: str, tenant: TenantTag | None, tokens: int = 8, priority: int = 0,
           prompt: int = 4) -> None:
    params = {"num_tokens_to_generate": tokens, **({"priority": priority} if priority else {})}
    if tenant is not None:
        params["tenant"] = msgspec.to_builtins(tenant)
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=list(range(1, prompt + 1)),
                                    sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))


def dispatched(h: CoreHarness, identity: bytes = E1) -> list[str]:
    return [body.request["request_id"].split("/", 1)[1] for body in h.take(identity, Header.ENGINE_SUBMIT)]


class FakeEngine:
    """Runs what the coordinator sends, first come first served, ``capacity`` at a time: one token per request and
    step, finishing at its ``num_tokens_to_generate``."""

    def __init__(self, h: CoreHarness, identity: bytes, capacity: int) -> None:
        self.h, self.identity = h, identity
        self.engine_id = h.engine(identity, group=0, capacity=capacity)
        self.capacity = capacity
        self.queue: list[dict] = []  # received, not finished (running: the first `capacity`)
        self.generated: dict[str, int] = {}

    def step(self) -> list[str]:
        """One step; returns the requests that made a token."""
        self.queue += [body.request for body in self.h.take(self.identity, Header.ENGINE_SUBMIT)]
        outputs, records, ran = [], {}, []
        for request in list(self.queue[: self.capacity]):
            rid = request["request_id"]
            done = self.generated.get(rid, 0) + 1
            self.generated[rid] = done
            finished = done >= request["sampling_params"]["num_tokens_to_generate"]
            outputs.append(msgspec.Raw(msgspec.msgpack.encode(RequestDelta(request_id=rid, new_tokens=[7],
                                                                           finished=finished))))
            if finished:
                records[rid] = msgspec.Raw(msgspec.msgpack.encode({"request_id": rid, "status": "COMPLETED",
                                                                   "finish_reason": "length"}))
            ran.append(rid)
            if finished:
                self.queue.remove(request)
        if outputs:
            self.h.send(self.identity, Header.ENGINE_STEP, EngineStep(engine_id=self.engine_id, outputs=outputs,
                                                                              records=records))
        return ran


A, B = TenantTag("a", "standard", 1.0), TenantTag("b", "standard", 3.0)


def test_bands_are_strict_and_priority_orders_a_tenants_own_requests():
    h = CoreHarness(dispatch_factor=1.0)
    h.client(C)
    shed, std, crit = TenantTag("s", "sheddable"), TenantTag("t", "standard"), TenantTag("c", "critical")
    for crid, tag, priority in (("s1", shed, 0), ("t1", std, 5), ("t2", std, -5), ("c1", crit, 0), ("s2", shed, 0)):
        submit(h, crid, tag, priority=priority)
    FakeEngine(h, E1, capacity=5)
    assert dispatched(h) == ["c1", "t2", "t1", "s1", "s2"]


def generated(a: TenantTag | None, b: TenantTag | None, queued: int) -> Counter[str]:
    """Tokens of requests ``a0``.. (tenant ``a``) and ``b0``.. (tenant ``b``), ``queued`` of each submitted in
    turn, over 200 steps of one engine that runs 4 at a time: by the requests' first letter."""
    h = CoreHarness(dispatch_factor=1.0)
    h.client(C)
    engine = FakeEngine(h, E1, capacity=4)
    for i in range(queued):
        submit(h, f"a{i}", a)
        submit(h, f"b{i}", b)
    tokens: Counter[str] = Counter()
    for _ in range(200):
        tokens.update(rid.split("/")[1][0] for rid in engine.step())
    return tokens


def test_weights_one_to_three_get_generated_tokens_one_to_three():
    tokens = generated(A, B, 150)  # both tenants keep more queued than the engine runs: contention all along
    assert tokens["a"] + tokens["b"] == 800
    assert abs(tokens["b"] / tokens["a"] - 3.0) <= 0.3, tokens


def test_control_without_tenants_the_queue_is_first_come_first_served():
    tokens = generated(None, None, 60)
    assert tokens["a"] == tokens["b"] == 400  # arrival order alternates: equal, whatever weights would say


def test_a_better_band_is_sent_to_an_engine_full_of_worse_ones_and_an_equal_one_waits():
    h = CoreHarness(dispatch_factor=1.0)
    h.client(C)
    FakeEngine(h, E1, capacity=2)
    flood = TenantTag("bulk", "sheddable")
    for i in range(4):
        submit(h, f"s{i}", flood)
    assert dispatched(h) == ["s0", "s1"]  # the engine's room: 2
    submit(h, "c0", TenantTag("chat", "critical"))
    submit(h, "t0", TenantTag("team", "standard"))
    assert dispatched(h) == ["c0", "t0"]  # room counted in their bands: none of theirs is assigned
    submit(h, "c1", TenantTag("chat", "critical"))
    submit(h, "t1", TenantTag("team", "standard"))
    assert dispatched(h) == ["c1"]  # critical: c0 alone counts against its room; standard: c0 and t0 fill it
    submit(h, "c2", TenantTag("chat", "critical"))
    assert dispatched(h) == []


def test_a_request_waiting_long_is_promoted_a_band_per_period():
    h = CoreHarness(dispatch_factor=1.0, heartbeat_timeout=1e6, stall_timeout=1e6)
    h.client(C)
    engine = FakeEngine(h, E1, capacity=1)
    submit(h, "busy", TenantTag("chat", "critical"), tokens=1000)
    assert dispatched(h) == ["busy"]
    submit(h, "old", TenantTag("bulk", "sheddable"))
    h.advance(45.0)  # 1.5 periods: one band better (standard)
    submit(h, "new", TenantTag("team", "standard"))
    table = h.core.flow.table
    assert table.next_queued(h.now).client_request_id == "old" and table.head_band == 1
    h.advance(20.0)  # two periods: critical
    assert table.next_queued(h.now).client_request_id == "old" and table.head_band == 0
    assert dispatched(h) == []  # critical room is held by `busy`
    engine.queue.clear()


def test_a_tenant_back_from_idle_starts_at_the_least_count_of_those_waiting():
    queue = FairQueue(lambda key, order: None)
    queue.policy.counts = {"a": 100.0, "b": 250.0, "ahead": 300.0}
    queue.bands[1] = {"a": [(0, 1, "x")], "b": [(0, 2, "y")]}
    queue.push(Queued("idle"), 3, None)  # never counted: it starts level with the least waiting, not at 0
    queue.push(Queued("ahead"), 4, None)  # counted more than that: it keeps its count
    assert queue.policy.counts == {"a": 100.0, "b": 250.0, "ahead": 300.0, "idle": 100.0}


class Queued:
    """A standard-class request of ``tenant`` as the tenants' queue reads it."""

    def __init__(self, tenant: str) -> None:
        self.request_id = tenant
        self.params = SamplingParams(tenant=TenantTag(name=tenant, priority_class="standard"))
        self.prompt_tokens: list[int] = []
        self.queued_at = None
        self.charged = 0
        self.generated_tokens: list[int] = []


def test_a_request_is_charged_its_prompt_and_max_tokens_and_given_back_what_it_did_not_use():
    h = CoreHarness(dispatch_factor=1.0)
    h.client(C)
    engine = FakeEngine(h, E1, capacity=1)
    submit(h, "a0", B, tokens=10, prompt=6)  # weight 3
    assert h.core.flow.table.fair.policy.counts["b"] == (6 + 10) / 3
    engine.step()
    request = engine.queue[0]
    request["sampling_params"]["num_tokens_to_generate"] = 2  # it stops early (as at a stop string or EOS)
    engine.step()
    assert h.core.flow.table.fair.policy.counts["b"] == (6 + 2) / 3


def test_a_request_dropped_without_finishing_gives_back_what_it_did_not_use():
    h = CoreHarness(dispatch_factor=1.0)
    h.client(C)
    engine = FakeEngine(h, E1, capacity=1)
    submit(h, "a0", B, tokens=10, prompt=6)
    engine.step()
    engine.step()  # two tokens made
    (record,) = h.core.flow.table.records.values()
    assert len(record.generated_tokens) == 2
    h.core.flow.table.forget(record)  # its client gone: the table drops it unfinished
    assert h.core.flow.table.fair.policy.counts["b"] == (6 + 2) / 3


def test_promoted_requests_count_in_their_promoted_band_so_an_engine_holds_a_bounded_number():
    """The fan-out of issue 86: a tenant's queue far deeper than the fleet's room, promoted after waiting. Room counted
    by each request's own class let every promoted request find room (the ones dispatched before it counted in a worse
    band), so the whole queue went to one engine; counted by the band each was sent in, an engine takes at most its
    limit per band."""
    h = CoreHarness(dispatch_factor=1.0, heartbeat_timeout=1e6, stall_timeout=1e6)
    h.client(C)
    engine = FakeEngine(h, E1, capacity=2)
    bulk = TenantTag("bulk", "sheddable")
    for i in range(200):
        submit(h, f"s{i}", bulk, tokens=1000)
    assert len(dispatched(h)) == 2  # its own band's room
    h.advance(31.0)  # every waiting one counts as standard now
    assert len(dispatched(h)) == 2  # standard's room, not the 198 waiting
    h.advance(30.0)  # critical
    assert len(dispatched(h)) == 2
    h.advance(300.0)  # no better band than critical: nothing more until one finishes
    assert dispatched(h) == []
    assert h.core.flow.table.count(Phase.QUEUED) == 194
    engine.queue.clear()
