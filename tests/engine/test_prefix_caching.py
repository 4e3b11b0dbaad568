"""Prefix caching: identical outputs, fewer prefill tokens, LRU eviction children first, the worst band first."""

from __future__ import annotations

import random

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.kv.cache import BlockAllocator
from megatron_serve.wire.prefix_hash import block_hashes

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)


def shared_prefix_workload(count: int = 200, prefixes: int = 4, prefix_len: int = 6 * BLOCK, seed: int = 0):
    rng = random.Random(seed)
    heads = [[rng.randrange(5, 500) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = [heads[i % prefixes] + [rng.randrange(5, 500) for _ in range(rng.randint(3, 20))] for i in range(count)]
    return prompts, prefix_len


def run(model_dir: str, prompts, caching: bool):
    llm = MegatronLLM(model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=96, max_batch_tokens=256,
                                                 max_requests=16, enable_prefix_caching=caching))
    outs = llm.generate(prompts, PARAMS)
    return [o.generated_tokens for o in outs], llm.engine, outs


def test_outputs_equal_and_prefill_drops_by_the_shared_fraction(tiny_llama):
    prompts, prefix_len = shared_prefix_workload()
    off_tokens, off_engine, _ = run(tiny_llama, prompts, caching=False)
    on_tokens, on_engine, outs = run(tiny_llama, prompts, caching=True)
    assert on_tokens == off_tokens
    # Memory pressure: 96 blocks cannot hold 200 requests' blocks, so cached blocks were evicted and reused.
    assert on_engine.allocator.num_cached < sum(len(p) // BLOCK for p in prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    shared_fraction = (len(prompts) - 4) * prefix_len / prompt_tokens  # every use of a prefix after its first
    drop = (off_engine.load().computed_tokens - on_engine.load().computed_tokens) / prompt_tokens
    assert drop >= shared_fraction, (drop, shared_fraction)
    assert on_engine.load().cached_tokens >= (len(prompts) - 4) * prefix_len
    assert sum(o.cached_tokens for o in outs) > 0 and all(o.cached_tokens <= prefix_len for o in outs)


def test_a_burst_sharing_a_new_prefix_computes_it_once(tiny_llama):
    prefix = list(range(30, 30 + 4 * BLOCK))
    prompts = [prefix + [100 + i, 200 + i, 300 + i] for i in range(8)]
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, enable_prefix_caching=True))
    outs = llm.generate(prompts, PARAMS)  # all eight wait together: the first computes the prefix, the rest reuse it
    assert sorted(o.cached_tokens for o in outs) == [0] + [4 * BLOCK] * 7
    alone = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, enable_prefix_caching=False))
    assert [o.generated_tokens for o in outs] == [o.generated_tokens for o in alone.generate(prompts, PARAMS)]


def test_fully_cached_prompt_still_computes_its_last_token(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, enable_prefix_caching=True))
    prompt = list(range(10, 10 + 4 * BLOCK))  # exactly four blocks
    first = llm.generate([prompt], PARAMS)[0]
    second = llm.generate([prompt], PARAMS)[0]
    assert second.generated_tokens == first.generated_tokens
    assert second.cached_tokens == 3 * BLOCK


def test_cache_is_dropped_on_suspend_and_outputs_stay_correct(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, enable_prefix_caching=True))
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    first = llm.generate([prompt], PARAMS)[0]
    llm.engine.memory.suspend()
    assert llm.engine.allocator.num_cached == 0
    llm.engine.memory.resume()
    again = llm.generate([prompt], PARAMS)[0]
    assert again.cached_tokens == 0 and again.generated_tokens == first.generated_tokens


def test_lru_eviction_takes_children_before_parents():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    tokens = list(range(3 * 4))
    hashes = block_hashes(tokens, 4)
    table = allocator.allocate(3)
    for block, block_hash in zip(table, hashes):
        allocator.register(block, block_hash)
    allocator.free(table)
    assert allocator.num_free == 4 and allocator.num_cached == 3
    allocator.allocate(1)  # the never-cached block
    allocator.allocate(1)  # evicts the deepest child first
    assert allocator.lookup(hashes) == table[:2]
    allocator.allocate(1)
    assert allocator.lookup(hashes) == table[:1]


def cached_chain(allocator: BlockAllocator, first_token: int, band: int, length: int = 2) -> list[int]:
    """``length`` blocks of a chain computed for a request of ``band``, registered and freed (evictable)."""
    hashes = block_hashes([first_token + i for i in range(4 * length)], 4)
    table = allocator.allocate(length, band)
    for block, block_hash in zip(table, hashes):
        allocator.register(block, block_hash)
    allocator.free(table)
    return hashes


def test_eviction_takes_the_worst_band_first_and_the_least_recently_freed_within_a_band():
    allocator = BlockAllocator(8, enable_prefix_caching=True)
    chains = {"critical": cached_chain(allocator, 100, 0),  # freed first: plain LRU would evict it first
              "sheddable_old": cached_chain(allocator, 200, 2),
              "standard": cached_chain(allocator, 300, 1),
              "sheddable_new": cached_chain(allocator, 400, 2)}
    assert allocator.num_free == 8 and allocator.num_cached == 8
    before, order = dict.fromkeys(chains, 2), []
    for _ in range(8):
        allocator.allocate(1, 0)
        now = {name: len(allocator.lookup(hashes)) for name, hashes in chains.items()}
        order += [(name, now[name]) for name in chains if now[name] < before[name]]
        before = now
    assert order == [("sheddable_old", 1), ("sheddable_old", 0), ("sheddable_new", 1), ("sheddable_new", 0),
                     ("standard", 1), ("standard", 0), ("critical", 1), ("critical", 0)]  # each chain child first


def test_a_shared_block_keeps_the_best_band_that_held_it_since_it_was_last_evictable():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    hashes = cached_chain(allocator, 100, 2)  # a sheddable request's two blocks
    parent, child = allocator.lookup(hashes)
    allocator.acquire([parent], 0)  # a critical request shares the parent...
    allocator.acquire([parent, child], 2)  # ...with a sheddable one that holds the chain
    allocator.free([parent])  # the critical request leaves first
    allocator.free([parent, child])  # the sheddable one frees both last
    newer = cached_chain(allocator, 200, 2, length=1)
    allocator.allocate(2, 2)  # the never-cached block, then the sheddable band's least recently freed: the child
    assert allocator.lookup(hashes) == [parent] and allocator.lookup(newer) != []
    allocator.allocate(1, 2)
    assert allocator.lookup(hashes) == [parent] and allocator.lookup(newer) == []  # the parent stays critical's


def test_shared_blocks_are_reference_counted():
    allocator = BlockAllocator(4, enable_prefix_caching=True)
    hashes = block_hashes(list(range(8)), 4)
    table = allocator.allocate(2)
    for block, block_hash in zip(table, hashes):
        allocator.register(block, block_hash)
    found = allocator.lookup(hashes)
    allocator.acquire(found)
    assert [allocator.ref_count(b) for b in table] == [2, 2]
    allocator.free(table)
    assert allocator.num_free == 2  # still referenced by the second user
    allocator.free(found)
    assert allocator.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free([table[0]])


def test_prefix_hashes_are_stable_and_chained():
    tokens = list(range(40))
    assert block_hashes(tokens, 16) == block_hashes(tokens[:32], 16)
    other = block_hashes([99] + tokens[1:], 16)
    assert other[0] != block_hashes(tokens, 16)[0] and other[1] != block_hashes(tokens, 16)[1]


def test_engine_request_with_cached_prefix_reports_it(tiny_llama):
    engine = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, enable_prefix_caching=True)).engine
    prompt = list(range(20, 20 + 2 * BLOCK + 3))
    for rid in ("a", "b"):
        request = DynamicInferenceRequest(rid, None, prompt, PARAMS)
        engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
    assert request.cached_tokens == 2 * BLOCK
