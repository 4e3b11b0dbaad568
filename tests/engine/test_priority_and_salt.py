"""``priority`` and ``cache_salt`` where they act: the engine scheduler's queue, the coordinator's dispatch
queue, and the prefix-hash chains that engines and ``prefix_affinity`` routing must agree on.

No processes: the scheduler over a real block allocator, the coordinator's request table, the routing
policy with a stand-in engine view. The HTTP behaviour is in ``tests/server/test_vllm_fields.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

from megatron_serve.coordinator.requests import Phase, RequestRecord, RequestTable
from megatron_serve.engine.kv.cache import BlockAllocator
from megatron_serve.engine.scheduler import Scheduler
from megatron_serve.engine.sequence import Sequence
from megatron_serve.wire.prefix_hash import ROOT_HASH, block_hashes, salted_root
from megatron_serve.coordinator.prefix_routing import PrefixAffinity
from megatron_serve.wire.request import EngineRequest
from megatron_serve.wire.sampling_params import SamplingParams

BLOCK = 4


def sequence(name: str, tokens: list[int], **params) -> Sequence:
    request = EngineRequest(request_id=name, prompt_tokens=tokens, sampling_params=SamplingParams(**params),
                            arrival_time=0.0)
    return Sequence.of(request, len(tokens) + 4, frozenset())


def test_scheduler_admits_lower_priority_values_first_then_by_arrival():
    scheduler = Scheduler(BlockAllocator(64, enable_prefix_caching=False), BLOCK, max_batch_tokens=64,
                          max_requests=1)
    for name, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5), ("f", -1)):
        scheduler.add(sequence(name, [1, 2, 3], priority=priority))
    assert [s.request_id for s in scheduler.waiting] == ["c", "f", "a", "d", "b", "e"]
    admitted = [entry[0].request_id for entry in scheduler.schedule().entries]
    assert admitted == ["c"]  # one slot: the lowest value, first come


def test_coordinator_queue_dispatches_by_priority_and_moved_requests_first():
    table = RequestTable()

    def record(key: str, priority: int = 0) -> RequestRecord:
        return RequestRecord(key, "client", key, [1], SamplingParams(priority=priority), b"", False)

    for key, priority in (("a", 0), ("b", 3), ("c", -2), ("d", 0), ("e", -2), ("gone", -5)):
        table.add(record(key, priority), Phase.QUEUED)
    table.forget(table.get("gone"))  # aborted while queued: its heap entry is skipped
    order = []
    while (head := table.next_queued()) is not None:
        order.append(head.request_id)
        table.pop_queued()
        table.dispatched(head, "engine")
    assert order == ["c", "e", "a", "d", "b"]
    moved = table.get("b")
    table.add(record("late", -9), Phase.QUEUED)
    table.enqueue(moved, first=True)  # it lost its engine: ahead of everything
    assert table.next_queued() is moved
    table.pop_queued()
    assert table.next_queued().request_id == "late"


def test_a_salt_roots_the_chain_and_engines_and_routing_agree():
    tokens = list(range(10, 10 + 4 * BLOCK + 1))
    assert salted_root(None) == ROOT_HASH and salted_root("t1") != salted_root("t2") != ROOT_HASH
    unsalted, salted = block_hashes(tokens, BLOCK), block_hashes(tokens, BLOCK, salted_root("t1"))
    assert not set(unsalted) & set(salted)  # the salt changes the first block's hash and so every one after it

    allocator = BlockAllocator(64, enable_prefix_caching=True)
    scheduler = Scheduler(allocator, BLOCK, max_batch_tokens=256, max_requests=4)
    first = sequence("first", tokens, cache_salt="t1")
    scheduler.add(first)
    scheduler.schedule()
    first.num_computed = len(tokens)
    scheduler.blocks.register_computed(first, scheduler.epoch)
    # the coordinator's routing hashes a salted prompt exactly as the engine cached it
    record = RequestRecord("r", "client", "r", tokens, SamplingParams(cache_salt="t1"), b"", False)
    engine = SimpleNamespace(engine_id="e0", group=0, capacity=4, kv_blocks_free=60, kv_blocks_total=64, load=0,
                             stats={}, info={"block_size": BLOCK, "prefix_caching": True})
    routing = PrefixAffinity()
    routing.select(record, [engine])
    assert routing.match("e0", first.block_hashes) == len(first.block_hashes) == 4
    for salt, cached in (("t1", 4 * BLOCK), ("t2", 0), (None, 0)):
        other = sequence(f"again-{salt}", tokens, cache_salt=salt)
        scheduler.add(other)
        scheduler.schedule()
        assert other.num_computed == cached, salt
