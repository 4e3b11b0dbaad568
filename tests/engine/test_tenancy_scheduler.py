"""The engine's policy for requests of tenants (engine/tenancy.py, docs/tenants.md) on the scheduler alone, with
no model: strict bands, a better band taking a worse one's slot or KV blocks (its tokens kept), fair shares by
tokens within a band, promotion after waiting, and untagged requests scheduled as before."""

from __future__ import annotations

from collections import Counter

from megatron_serve.engine.scheduler import Scheduler
from megatron_serve.engine.tenancy import TenantPolicy
from megatron_serve.wire.request import EventType, RequestStatus
from megatron_serve.wire.tenancy import TenantTag

from .test_scheduler import play, request, scheduler

BULK = TenantTag("bulk", "sheddable")
CHAT = TenantTag("chat", "critical")
TEAM = TenantTag("team", "standard")


def running(sched) -> list[str]:
    return [s.request_id for s in sched.running]


def test_a_critical_request_takes_the_newest_sheddable_slot_at_the_next_step_and_the_victim_keeps_its_tokens():
    sched = scheduler(max_requests=2)
    for name in ("s0", "s1"):
        sched.add_request(request(name, 5, num_tokens_to_generate=20, tenant=BULK))
    for _ in range(3):
        play(sched)
    victim = sched.requests["s1"]
    tokens = list(victim.token_ids)
    sched.add_request(request("c0", 5, tenant=CHAT))
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["s1"]  # the newest of the worst band
    assert {s.request_id for s, _ in batch.entries} == {"c0"} and running(sched) == ["c0", "s0"]  # s0 sits it out
    assert victim.status is RequestStatus.WAITING_IN_QUEUE and victim.token_ids == tokens
    assert victim.block_table == [] and victim.num_computed == 0  # recomputed from its tokens when it runs again
    assert [e.type for e in victim.events][-1] is EventType.PREEMPT


def flooded(slots: int) -> Scheduler:
    """A scheduler whose ``slots`` slots all run sheddable streams, each decoding."""
    sched = scheduler(max_requests=slots)
    for index in range(slots):
        sched.add_request(request(f"s{index}", 5, num_tokens_to_generate=40, tenant=BULK))
    for _ in range(3):
        play(sched)
    return sched


def test_the_step_a_critical_request_displaces_in_computes_it_alone_and_the_flood_decodes_at_the_next():
    """The displacing step holds the critical prompt only (the flood's decodes would make the step it waits for
    longer than its own work); the sheddable streams that kept their slots decode again at the step after it, beside
    the critical request's first decode."""
    sched = flooded(4)
    sched.add_request(request("c0", 5, tenant=CHAT))
    counts, _ = play(sched)
    assert counts == {"c0": 5} and running(sched) == ["c0", "s0", "s1", "s2"]
    counts, _ = play(sched)
    assert counts == {"c0": 1, "s0": 1, "s1": 1, "s2": 1}


def test_control_a_critical_request_in_a_free_slot_runs_beside_the_flood():
    """Nothing displaced, nothing left out: a critical request that finds a free slot shares the step."""
    sched = flooded(4)
    sched.abort_request("s3")
    sched.add_request(request("c0", 5, tenant=CHAT))
    counts, _ = play(sched)
    assert counts == {"c0": 5, "s0": 1, "s1": 1, "s2": 1}


def test_worse_bands_sit_out_at_most_one_step_in_two():
    """Critical requests that displace at every step: the sheddable streams still running decode every other step
    (a stream of better requests slows a worse band, never stops it), and every critical prompt runs at the step it
    displaced in."""
    sched = flooded(6)
    decoded = []
    for index in range(4):
        sched.add_request(request(f"c{index}", 5, num_tokens_to_generate=20, tenant=CHAT))
        counts, _ = play(sched)
        assert counts[f"c{index}"] == 5
        decoded.append(sorted(name for name in counts if name.startswith("s")))
    assert decoded == [[], ["s0", "s1", "s2", "s3"], [], ["s0", "s1"]]


def test_control_untagged_requests_never_displace_one_another_whatever_their_priority():
    sched = scheduler(max_requests=2)
    for name in ("s0", "s1"):
        sched.add_request(request(name, 5, num_tokens_to_generate=20, priority=5))
    play(sched)
    sched.add_request(request("c0", 5, priority=-5))
    batch = sched.schedule()
    assert batch.preempted == [] and running(sched) == ["s0", "s1"] and sched.tenancy is None


def test_with_vllms_priority_policy_a_smaller_priority_takes_the_slot_of_the_largest_newest():
    """vLLM's --scheduling-policy priority, no tenants: the same displacement as between classes, by priority value
    (the control above: the default policy only orders admission)."""
    sched = scheduler(max_requests=2, scheduling_policy="priority")
    sched.add_request(request("s0", 5, num_tokens_to_generate=20, priority=10))
    sched.add_request(request("s1", 5, num_tokens_to_generate=20, priority=5))
    play(sched)
    victim = sched.requests["s0"]
    tokens = list(victim.token_ids)
    sched.add_request(request("c0", 5, priority=10))  # no better than the worst running one: it waits
    assert sched.schedule().preempted == [] and running(sched) == ["s1", "s0"]
    sched.add_request(request("c1", 5, priority=0))
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["s0"]  # the largest value's, not the newest running
    assert running(sched) == ["c1", "s1"] and victim.token_ids == tokens
    assert [s.request_id for s in sched.waiting] == ["s0", "c0"]  # the victim ahead of its equals, tokens kept


def test_an_equal_band_waits_for_a_free_slot():
    sched = scheduler(max_requests=2)
    for name in ("t0", "t1"):
        sched.add_request(request(name, 5, num_tokens_to_generate=20, tenant=TEAM))
    play(sched)
    sched.add_request(request("t2", 5, tenant=TenantTag("other", "standard")))
    assert sched.schedule().preempted == [] and running(sched) == ["t0", "t1"]


def test_bands_are_strict_when_a_slot_frees():
    sched = scheduler(max_requests=1)
    sched.add_request(request("busy", 5, num_tokens_to_generate=2, tenant=CHAT))
    play(sched)
    for name, tag in (("s", BULK), ("t", TEAM), ("c", CHAT)):
        sched.add_request(request(name, 5, tenant=tag))
    order = []
    for _ in range(30):
        counts, _ = play(sched)
        order += [name for name in counts if name not in order]
    assert order == ["busy", "c", "t", "s"]


def test_kv_blocks_for_a_better_band_come_from_the_worst_running_request():
    sched = scheduler(num_blocks=8, max_requests=4)  # blocks of 4 tokens
    for name in ("s0", "s1"):
        sched.add_request(request(name, 14, num_tokens_to_generate=2, tenant=BULK))  # 4 blocks each: the pool
    play(sched)
    assert sched.allocator.num_free == 0
    sched.add_request(request("c0", 6, tenant=CHAT))
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["s1"] and "c0" in {s.request_id for s, _ in batch.entries}
    assert running(sched) == ["c0", "s0"]


def test_weights_one_to_three_get_tokens_one_to_three_within_a_band():
    sched = scheduler(num_blocks=256, max_requests=4)
    light, heavy = TenantTag("light", "standard", 1.0), TenantTag("heavy", "standard", 3.0)
    for i in range(100):  # more than either gets in the steps played: both wait all along
        sched.add_request(request(f"l{i}", 4, num_tokens_to_generate=8, tenant=light, ignore_eos=True))
        sched.add_request(request(f"h{i}", 4, num_tokens_to_generate=8, tenant=heavy, ignore_eos=True))
    generated: Counter[str] = Counter()
    for _ in range(120):
        _, outputs = play(sched)
        generated.update(out.request_id[0] for out in outputs if out.new_tokens)
    assert abs(generated["h"] / generated["l"] - 3.0) <= 0.3, generated


def test_a_request_waiting_long_is_promoted_and_then_takes_a_slot():
    sched = scheduler(max_requests=1)
    sched.tenancy = TenantPolicy(promote_after=3)
    sched.add_request(request("busy", 5, num_tokens_to_generate=100, tenant=TEAM))
    play(sched)
    sched.add_request(request("old", 5, tenant=BULK))
    steps = 0
    while "old" not in running(sched):
        play(sched)
        steps += 1
    assert steps == 2 * 3 + 1  # two bands better after two periods: critical, which displaces the standard one


def prefix_hit_after_a_flood(chat: TenantTag | None, flood: TenantTag | None) -> tuple[int, int]:
    """A chat request caches a 3-block system prompt and finishes; a flood of 8 other requests (4 blocks each, 32 in
    all) then passes through the 16-block pool; a second chat request with the system prompt comes. Returns the
    second's tokens found in the prefix cache and the blocks the flood made the pool evict."""
    sched = scheduler(num_blocks=16, max_requests=2, prefix_caching=True)
    system = [60 + i for i in range(12)]
    sched.add_request(request("c0", system + [1, 3], num_tokens_to_generate=2, tenant=chat, ignore_eos=True))
    while sched.has_work():
        play(sched)
    assert sched.allocator.num_cached == 3
    for i in range(8):  # distinct first tokens: no block shared with the system prompt or one another
        sched.add_request(request(f"f{i}", [i + 3] + [20 + j for j in range(13)], num_tokens_to_generate=2,
                                  tenant=flood, ignore_eos=True))
    while sched.has_work():
        play(sched)
    sched.add_request(request("c1", system + [4, 5], num_tokens_to_generate=2, tenant=chat, ignore_eos=True))
    play(sched)
    return sched.requests["c1"].cached_tokens, 8 * 4 - (16 - 4)


def test_kv_eviction_takes_a_sheddable_floods_blocks_before_a_critical_tenants_cached_prompt():
    cached, evicted = prefix_hit_after_a_flood(CHAT, BULK)
    assert evicted > 0 and cached == 12  # the system prompt's three blocks, every one still cached


def test_control_under_plain_lru_the_same_flood_evicts_the_prompt():
    """Untagged (no tenants: every block in one band, least recently freed first), the oldest blocks go first."""
    assert prefix_hit_after_a_flood(None, None)[0] == 0
    assert prefix_hit_after_a_flood(BULK, CHAT)[0] == 0  # and a critical flood takes a sheddable prompt's blocks
