"""``prefix_affinity`` routing in-process: chain matching, the load bound, the bounded history, forgetting.

The policy is exercised directly on stand-in engine views; the coordinator hooks (drain, suspend,
leave) run against a real ``Coordinator`` and ``EngineProcess`` objects over sockets with fake engines.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.messages import Control, ControlAck, Draining, Heartbeat, Refit, Status, Suspend
from megatron_serve.wire.prefix_hash import ROOT_HASH, block_hashes
from megatron_serve.coordinator.prefix_routing import DEFAULT_MAX_LOAD_GAP, DEFAULT_MAX_LOAD_RATIO, PrefixAffinity
from megatron_serve.wire.protocol import Header
from megatron_serve.coordinator.routing import make_routing_policy
from megatron_serve.wire.sampling_params import SamplingParams

from .core_harness import CoreHarness
from ..helpers import until

pytestmark = pytest.mark.timeout(120)

BS = 4


def engine(group: int, load: int = 0, block_size: int | None = BS, caching: bool = True, kv_blocks: int = 1024,
           capacity: int = 16):
    info = {} if block_size is None else {"block_size": block_size, "prefix_caching": caching}
    return SimpleNamespace(engine_id=f"e{group + 1}-g{group}", group=group, capacity=capacity, kv_blocks_free=kv_blocks,
                           kv_blocks_total=kv_blocks, stats={}, info=info, load=load)


def request(tokens: list[int], root: int = ROOT_HASH):
    return SimpleNamespace(request_id="r", prefix_keys=list(tokens), prefix_root=root)


def seq(start: int, blocks: int, tail: int = 1) -> list[int]:
    return list(range(start, start + blocks * BS + tail))


def test_registered_under_its_design_name_and_bounds_stated():
    policy = make_routing_policy("prefix_affinity")
    assert isinstance(policy, PrefixAffinity) and policy.name == "prefix_affinity"
    assert (DEFAULT_MAX_LOAD_GAP, DEFAULT_MAX_LOAD_RATIO) == (4, 1.5)
    assert policy.bound.limit(0) == 4 and policy.bound.limit(4) == 8 and policy.bound.limit(20) == 30
    with pytest.raises(ValueError):
        PrefixAffinity(max_load_ratio=0.5)


def test_longest_routed_chain_wins():
    policy = PrefixAffinity()
    e0, e1, e2 = engine(0), engine(1), engine(2)
    base = seq(100, 6)
    assert policy.select(request(base[: 3 * BS + 1]), [e1]) is e1  # e1 was sent the first 3 blocks
    assert policy.select(request(base), [e0]) is e0  # e0 was sent all 6 blocks
    assert policy.match(e0.engine_id, block_hashes(base, BS)) == 6
    assert policy.match(e1.engine_id, block_hashes(base, BS)) == 3
    # A prompt with the 6-block prefix and another tail goes to e0, even with a little more load there.
    e0.load = 2
    assert policy.select(request(base[: 6 * BS] + [7, 8, 9]), [e0, e1, e2]) is e0
    # Sharing only the first 3 blocks: e0 and e1 tie on the match, e1 has less load.
    assert policy.select(request(base[: 3 * BS] + [1] * (2 * BS)), [e2, e1, e0]) is e1
    assert policy.affinity_hits == 2


def routed_to_group_0() -> tuple[PrefixAffinity, SimpleNamespace, SimpleNamespace, list[int]]:
    """A policy that has sent a 4-block prompt to group 0 (of groups 0 and 1, both idle); the policy, the two groups'
    views and the prompt."""
    policy = PrefixAffinity()
    e0, e1 = engine(0), engine(1)
    prompt = seq(0, 4)
    policy.select(request(prompt), [e0])
    return policy, e0, e1, prompt


def test_hashes_are_chained_and_the_last_token_is_not_matched():
    policy, e0, e1, prompt = routed_to_group_0()
    # Same blocks 1..3 after a different first block: no match at all (every hash covers the whole prefix).
    changed = [999] + prompt[1:]
    assert policy.match(e0.engine_id, block_hashes(changed, BS)) == 0
    policy.select(request(changed), [e1, e0])
    assert policy.affinity_hits == 0
    # Exactly one block long: the engine always computes the last token, so there is nothing to reuse.
    e1.load = 1
    assert policy.select(request(prompt[:BS]), [e1, e0]) is e0 and policy.affinity_hits == 0
    # Shorter than a block, or no block size reported / prefix caching off: plain least-loaded choice.
    assert policy.select(request([1, 2]), [e1, e0]) is e0
    off, unknown = engine(5, caching=False), engine(6, block_size=None)
    for other in (off, unknown):
        assert policy.select(request(prompt), [other]) is other
        assert policy.history_size(other.engine_id) == 0


def test_block_size_from_heartbeat_stats_and_mixed_sizes():
    policy = PrefixAffinity()
    small = engine(0, block_size=None)
    small.stats = {"block_size": 2}
    large = engine(1, block_size=8)
    prompt = list(range(40))
    policy.select(request(prompt), [small])
    policy.select(request(prompt), [large])
    assert policy.history_size(small.engine_id) == 20 and policy.history_size(large.engine_id) == 5
    # Both hold the whole prompt: matches compare in tokens (19 blocks of 2 vs 4 of 8), the finer blocks win.
    assert policy.select(request(prompt), [large, small]) is small


def test_a_hot_prefix_fills_its_group_up_to_the_load_bound_then_spills():
    """Requests of one prefix dispatched while nothing finishes: the bound holds at every dispatch."""
    policy = PrefixAffinity()
    groups = [engine(g) for g in range(3)]
    policy.select(request(seq(500, 8)), [groups[0]])  # group 0 holds the prefix
    chosen = []
    for i in range(12):
        pick = policy.select(request(seq(500, 8) + [i]), groups)
        loads = [g.load for g in groups]
        assert pick.load <= policy.bound.limit(min(loads)), (i, loads)
        pick.load += 1
        chosen.append(pick.group)
        assert max(g.load for g in groups) - min(g.load for g in groups) <= DEFAULT_MAX_LOAD_GAP + 1
    gap = DEFAULT_MAX_LOAD_GAP
    assert chosen == [0] * (gap + 1) + [1] * (gap + 1) + [2] * (12 - 2 * (gap + 1))
    assert policy.load_skips > 0
    # Beyond the gap the ratio part of the bound counts: least load 20 allows up to 30.
    policy = PrefixAffinity()
    busy = [engine(0, load=30), engine(1, load=20)]
    policy.select(request(seq(900, 4)), [busy[0]])
    assert policy.select(request(seq(900, 4)), busy) is busy[0]
    busy[0].load = 31
    assert policy.select(request(seq(900, 4)), busy) is busy[1]


def test_history_is_bounded_lru_and_evicts_children_before_parents():
    policy = PrefixAffinity(max_hashes_per_group=1000)
    e0 = engine(0, kv_blocks=8)  # its cache holds at most 8 blocks: so does the history
    first = seq(0, 3)
    policy.select(request(first), [e0])
    assert policy.match(e0.engine_id, block_hashes(first, BS)) == 3
    policy.select(request(seq(1000, 5)), [e0])
    assert policy.history_size(e0.engine_id) == 8 and policy.match(e0.engine_id, block_hashes(first, BS)) == 3
    policy.select(request(seq(2000, 1)), [e0])  # one more block: the leaf of the oldest chain goes first
    assert policy.history_size(e0.engine_id) == 8 and policy.match(e0.engine_id, block_hashes(first, BS)) == 2
    for k in range(50):
        policy.select(request(seq(10_000 + 100 * k, 6)), [e0])
        assert policy.history_size(e0.engine_id) <= 8
    capped = PrefixAffinity(max_hashes_per_group=4, max_prompt_blocks=3)
    big = engine(1, kv_blocks=0)  # pool size unknown: the configured cap alone
    capped.select(request(seq(0, 10)), [big])
    assert capped.history_size(big.engine_id) == 3  # only the first max_prompt_blocks are hashed
    capped.select(request(seq(100, 10)), [big])
    assert capped.history_size(big.engine_id) == 4


def test_a_host_tier_keeps_prefixes_routable_past_the_device_pool():
    """An engine with --kv-offloading-size finds prefixes its device pool let go (the host tier's blocks): routing
    remembers as many, and sends a prompt there that an engine of the same pool without a tier has forgotten."""
    policy = PrefixAffinity()
    plain, tiered = engine(0, kv_blocks=8), engine(1, kv_blocks=8)
    tiered.info["kv_offload_blocks"] = 64
    assert policy.capacity_for(plain) == 8 and policy.capacity_for(tiered) == 72
    early = seq(0, 3)
    for target in (plain, tiered):
        policy.select(request(early), [target])
        for k in range(4):  # 20 more blocks: past either device pool
            policy.select(request(seq(1000 * (k + 1), 5)), [target])
    assert policy.match(plain.engine_id, block_hashes(early, BS)) == 0
    assert policy.match(tiered.engine_id, block_hashes(early, BS)) == 3
    assert policy.select(request(early + [9, 9]), [plain, tiered]) is tiered
    tiered.info["kv_offload_blocks"] = True  # garbage from a peer: the device pool alone
    assert policy.capacity_for(tiered) == 8


def test_forget_drops_a_group_and_unknown_ids_are_fine():
    policy, e0, e1, prompt = routed_to_group_0()
    policy.forget("never-seen")
    policy.forget(e0.engine_id)
    assert policy.history_size(e0.engine_id) == 0
    e0.load = 1
    assert policy.select(request(prompt), [e0, e1]) is e1 and policy.affinity_hits == 0


def test_coordinator_forgets_a_draining_engine_and_reports_cache_counters():
    h = CoreHarness(routing="prefix_affinity")
    info = {"block_size": BS, "prefix_caching": True}
    ids = [h.engine(b"x%d" % g, group=g, **info) for g in range(2)]
    records = [h.core.members.engines[i] for i in ids]
    policy = h.core.dispatcher.policy
    assert policy.select(request(seq(0, 4)), records) is records[0]
    h.send(records[1].identity, Header.HEARTBEAT, Heartbeat(cached_tokens=48, computed_tokens=300))
    described = h.core.status(Status(), h.now).engines[1]
    assert (described["cached_tokens"], described["computed_tokens"]) == (48, 300)
    h.send(records[0].identity, Header.DRAINING, Draining(engine_id=records[0].engine_id))
    assert records[0].draining and policy.history_size(records[0].engine_id) == 0


def test_coordinator_forgets_after_a_refit_and_after_a_suspend_keeps_what_a_host_tier_holds():
    """A suspend frees the device pools: an engine without a host tier is forgotten, one with a tier (which took the
    pool's cached blocks) keeps its most recent prefixes, as many blocks as the tier holds. A refit forgets all."""
    h = CoreHarness(routing="prefix_affinity")
    h.client(b"c")
    info = {"block_size": BS, "prefix_caching": True}
    plain = h.core.members.engines[h.engine(b"x0", group=0, **info)]
    tiered = h.core.members.engines[h.engine(b"x1", group=1, **info, kv_offload_blocks=3)]
    records = [plain, tiered]
    policy = h.core.dispatcher.policy
    early, late = seq(0, 4), seq(1000, 2)

    def route_to_both() -> None:
        for record in records:
            policy.select(request(early), [record])
            policy.select(request(late), [record])
        assert all(policy.history_size(r.engine_id) == 6 for r in records)

    def verb(header: Header, body, *states: str) -> None:
        h.send(b"c", header, body)
        for index, state in enumerate(states):
            for record in records:
                h.send(record.identity, Header.CONTROL_ACK, ControlAck(control_id=f"{body.control_id}#{index}",
                                                                        state=state))
        assert h.take(b"c", Header.CONTROL_ACK)

    route_to_both()
    verb(Header.PAUSE, Control(control_id="p"), "PAUSED")  # caches stay
    assert all(policy.history_size(r.engine_id) for r in records)
    verb(Header.SUSPEND, Suspend(control_id="s"), "SUSPENDED")
    assert policy.history_size(plain.engine_id) == 0  # its cache went with the device pool
    assert policy.history_size(tiered.engine_id) == 3  # what its tier holds: the latest prompt's chain first
    assert policy.match(tiered.engine_id, block_hashes(late, BS)) == 2
    assert policy.select(request(late + [7]), records) is tiered
    verb(Header.RESUME, Control(control_id="r"), "PAUSED")
    route_to_both()
    verb(Header.REFIT, Refit(control_id="f", source="/w"), "PAUSED", "PAUSED")  # old weights' KV is gone
    assert not any(policy.history_size(r.engine_id) for r in records)


# ----------------------------------------------------------------------------- coordinator + engine processes


async def test_fleet_routes_a_prefix_to_one_engine_and_forgets_on_suspend_and_leave(fleet_factory):
    fleet = fleet_factory(routing="prefix_affinity")
    procs = [fleet.add_engine(max_requests=8, block_size=BS)[0] for _ in range(2)]  # engines that cache prefixes
    policy = fleet.coordinator.core.dispatcher.policy
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
    shared = seq(50, 5)
    async with InferenceClient(fleet.address, token=fleet.token) as client:
        status = await client.wait_for_engines(2, timeout=20, poll=0.02)
        assert all(e["info"]["block_size"] == BS and e["info"]["prefix_caching"] for e in status["engines"])
        for i in range(6):  # one at a time: every group idle, so only the prefix decides
            await client.add_request(shared + [i], params)
        status = await client.status()
        assert sorted(e["completed"] for e in status["engines"]) == [0, 6]
        holder = next(e for e in status["engines"] if e["completed"])
        assert policy.history_size(holder["id"]) > 0 and policy.affinity_hits == 5
        assert all("cached_tokens" in e and "computed_tokens" in e for e in status["engines"])

        await client.suspend()
        assert all(policy.history_size(e["id"]) == 0 for e in status["engines"])
        await client.resume()
        await client.unpause()
        await client.add_request(shared + [99], params)
        holder_id = next(eid for eid in list(fleet.coordinator.core.members.engines) if policy.history_size(eid))

        leaving = next(p for p in procs if p.shell.engine_id == holder_id)
        leaving.sigterm = True  # drains (forgotten at once), hands back nothing, leaves
        await until(lambda: policy.history_size(holder_id) == 0, 10, "the draining engine forgotten")
        await until(lambda: holder_id not in fleet.coordinator.core.members.engines, 20, "the engine to leave")
        result = await client.add_request(shared + [100], params)
        assert result.generated_tokens and policy.history_size(holder_id) == 0


def test_a_request_of_an_adapter_never_follows_the_base_models_or_another_adapters_prefix():
    """Engines key an adapter's blocks apart from the base model's (and every other adapter's): routing to the
    base prompt's engine would find nothing there. The record's root says which chain a request is on."""
    from megatron_serve.coordinator.requests import RequestRecord  # noqa: PLC0415

    def record(lora_name: str | None) -> RequestRecord:
        tokens = seq(100, 4) + [1]
        return RequestRecord(request_id="c/1", client_id="c", client_request_id=1, prompt_tokens=tokens,
                             params=SamplingParams(lora_name=lora_name), params_wire=b"", stream=False)

    roots = {name: record(name).prefix_root for name in (None, "sql", "chat")}
    assert roots[None] == ROOT_HASH and len(set(roots.values())) == 3
    policy = PrefixAffinity()
    e0, e1 = engine(0, load=1), engine(1)
    assert policy.select(record(None), [e0]) is e0
    assert policy.select(record(None), [e0, e1]) is e0  # control: the base prompt follows its prefix to e0
    assert policy.select(record("sql"), [e0, e1]) is e1  # the adapter's prompt has no prefix there: least loaded
