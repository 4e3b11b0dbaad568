"""The fleet's one queue policy, without a model, a coordinator or an engine: bands, promotion after waiting, fair
shares by virtual tokens, priority, arrival. Each rule has a control: the order it changes is asserted both ways."""

from __future__ import annotations

from collections import deque

import pytest

from megatron_serve.scheduling.queue_policy import QueuePolicy
from megatron_serve.wire.sampling_params import SamplingParams
from megatron_serve.wire.tenancy import STANDARD_BAND, TenantTag


def params(cls: str | None = None, priority: int = 0, tenant: str = "t") -> SamplingParams:
    tag = None if cls is None else TenantTag(name=tenant, priority_class=cls)
    return SamplingParams(tenant=tag, priority=priority)


def test_bands_are_strict_and_an_untenanted_request_is_standard():
    policy = QueuePolicy()
    ranks = {cls: policy.rank(params(cls)) for cls in ("critical", "standard", "sheddable")}
    assert ranks["critical"] < ranks["standard"] < ranks["sheddable"]
    assert policy.rank(params(None)) == ranks["standard"] == (STANDARD_BAND, 0)
    # the band decides before priority: a sheddable request of priority -100 still goes after a standard one
    assert policy.rank(params("standard", priority=50)) < policy.rank(params("sheddable", priority=-100))


def test_waiting_promotes_one_band_per_period_and_never_past_the_best():
    policy = QueuePolicy(promote_after=30.0)
    sheddable = params("sheddable")
    assert policy.band(sheddable, 29.9) == 2  # control: not yet
    assert policy.band(sheddable, 30.0) == 1
    assert policy.band(sheddable, 65.0) == 0
    assert policy.band(sheddable, 10_000.0) == 0
    assert QueuePolicy(promote_after=None).band(sheddable, 10_000.0) == 2  # no promotion without a period


def test_priority_ranks_within_a_band_only_when_asked():
    assert QueuePolicy().rank(params("standard", priority=-3)) == (1, -3)
    assert QueuePolicy(by_priority=False).rank(params("standard", priority=-3)) == (1, 0)


def test_place_keeps_priority_then_arrival():
    queue: deque[tuple[str, int]] = deque()
    for item in [("a", 0), ("b", 0), ("c", -1), ("d", 5), ("e", -1), ("f", 0)]:
        QueuePolicy.place(queue, item, lambda entry: entry[1])
    assert [name for name, _ in queue] == ["c", "e", "a", "b", "f", "d"]  # equal priorities keep their arrival


def test_before_compares_bands_then_arrival():
    assert QueuePolicy.before(0, 9.0, 1, 1.0)  # a better band goes first, whenever it came
    assert not QueuePolicy.before(2, 1.0, 1, 9.0)  # a worse one waits
    assert QueuePolicy.before(1, 1.0, 1, 2.0) and not QueuePolicy.before(1, 2.0, 1, 1.0)  # same band: arrival


def test_fair_shares_charge_by_weight_and_give_back_what_was_not_used():
    policy = QueuePolicy()
    policy.charge("heavy", 30, weight=3.0)
    policy.charge("light", 30, weight=1.0)
    assert policy.count("heavy") == pytest.approx(10.0) and policy.count("light") == pytest.approx(30.0)
    policy.refund("light", 12, weight=1.0)
    assert policy.count("light") == pytest.approx(18.0)
    policy.refund("never-counted", 5, weight=1.0)  # nothing to give back to
    assert "never-counted" not in policy.counts


def test_a_tenant_back_from_idle_starts_at_the_least_count_of_those_waiting():
    policy = QueuePolicy()
    policy.counts = {"a": 100.0, "b": 250.0, "ahead": 300.0}
    policy.join("idle", {"a", "b"})  # never counted: level with the least waiting, not at 0 (no banked share)
    policy.join("ahead", {"a", "b"})  # counted more than that: it keeps its count
    assert policy.counts == {"a": 100.0, "b": 250.0, "ahead": 300.0, "idle": 100.0}
    policy.join("alone", set())  # nobody waits: nothing to catch up with
    assert policy.count("alone") == 0.0


def test_tenants_gone_beyond_the_bound_are_forgotten():
    policy = QueuePolicy(max_counted=2)
    for name in ("w", "g1"):
        policy.charge(name, 10, 1.0)
    policy.join("new", {"w"})  # control: three counted, within the bound (2) beside the one waiting
    assert set(policy.counts) == {"w", "g1", "new"}
    policy.charge("g2", 10, 1.0)
    policy.join("newer", {"w"})
    assert policy.counts == {"w": 10.0, "newer": 10.0}  # the gone tenants start again when they return
