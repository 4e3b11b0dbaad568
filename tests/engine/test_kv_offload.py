"""The host KV tier (--kv-offloading-size): evicted prefixes come back from host memory, bitwise; epoch-keyed."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from megatron_serve.client.vllm_args import parse_llm_keywords
from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.fleet.argv import inference_config_to_argv
from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.kv.cache import BlockAllocator, KVCachePool
from megatron_serve.engine.kv.offload import TO_DEVICE, TO_HOST, Copier, HostKVTier
from megatron_serve.wire.tenancy import BANDS, STANDARD_BAND

BLOCK = 16
POOL = 24  # blocks: room for two of the prompts below at a time, not all six
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True)


def prompts(count: int = 6, length: int = 5 * BLOCK + 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(count)]


def llm(model_dir: str, tier_gib: float | None, **kwargs) -> MegatronLLM:
    return MegatronLLM(model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=POOL, max_requests=2,
                                                  max_batch_tokens=256, kv_offloading_size=tier_gib,
                                                  batch_invariant=True, **kwargs))


def two_passes(engine_llm: MegatronLLM, batch: list[list[int]]):
    first = [engine_llm.generate([p], PARAMS)[0] for p in batch]
    second = [engine_llm.generate([p], PARAMS)[0] for p in batch]
    return first, second


def test_a_working_set_larger_than_the_pool_comes_back_from_the_host_tier_bitwise(tiny_llama):
    batch = prompts()
    with_tier = llm(tiny_llama, 0.01)
    first, second = two_passes(with_tier, batch)
    assert [o.generated_tokens for o in second] == [o.generated_tokens for o in first]
    assert [o.generated_log_probs for o in second] == [o.generated_log_probs for o in first]
    cacheable = 5 * BLOCK
    assert [o.cached_tokens for o in first] == [0] * len(batch)
    assert [o.cached_tokens for o in second] == [cacheable] * len(batch)  # every prefix, from one tier or the other
    engine = with_tier.engine
    tier = engine.host_tier
    assert engine.scheduler.host_cached_tokens >= (len(batch) - 2) * cacheable  # most came back from the host
    assert tier.stats.bytes[TO_HOST] > 0 and tier.stats.bytes[TO_DEVICE] == (
        engine.scheduler.host_cached_tokens // BLOCK * tier.block_bytes)
    counters = engine.metrics_snapshot()["counters"]
    assert counters["external_prefix_cache_hits"] == engine.scheduler.host_cached_tokens
    assert counters["external_prefix_cache_queries"] >= counters["external_prefix_cache_hits"]
    assert engine.metrics_snapshot()["kv_offload"][TO_DEVICE]["bytes"] == tier.stats.bytes[TO_DEVICE]

    control = llm(tiny_llama, None)  # the same pool without a tier: the second pass finds few of its prefixes
    control_first, control_second = two_passes(control, batch)
    assert [o.generated_tokens for o in control_first] == [o.generated_tokens for o in first]
    assert sum(o.cached_tokens for o in control_second) < sum(o.cached_tokens for o in second) // 2


def test_a_refit_in_between_finds_nothing_in_either_tier(tiny_llama):
    batch = prompts()
    served = llm(tiny_llama, 0.01)
    first = [served.generate([p], PARAMS)[0] for p in batch]
    engine = served.engine
    assert engine.host_tier.num_cached > 0
    engine.memory.refit(tiny_llama)  # the same weights, a new epoch: KV of the old one must not be served
    assert engine.host_tier.num_cached == 0 and engine.allocator.num_cached == 0
    again = [served.generate([p], PARAMS)[0] for p in batch]
    assert [o.cached_tokens for o in again] == [0] * len(batch)
    assert [o.generated_tokens for o in again] == [o.generated_tokens for o in first]
    third = [served.generate([p], PARAMS)[0] for p in batch]  # the new epoch's blocks are found again
    assert all(o.cached_tokens == 5 * BLOCK for o in third)


def computed_across_a_refit(model_dir: str) -> int:
    """Cached tokens a request of the new weights finds for a sequence that a request of the old weights computed
    partly before a refit and partly after, once the new weights computed its prompt again."""
    served = llm(model_dir, None)
    engine = served.engine
    prompt = prompts(1, 2 * BLOCK + 1)[0]
    long = SamplingParams(temperature=0.0, num_tokens_to_generate=3 * BLOCK, ignore_eos=True)
    old = DynamicInferenceRequest("across", "", list(prompt), long)
    engine.add_request(old)
    for _ in range(3):
        engine.step()
    engine.memory.refit(model_dir)  # it keeps its KV and goes on: its later blocks chain from old-weights blocks
    while engine.has_unfinished_requests():
        engine.step()
    served.generate([prompt], PARAMS)  # the new weights compute and cache the prompt's two blocks
    return served.generate([list(prompt) + old.generated_tokens], PARAMS)[0].cached_tokens


def test_blocks_computed_across_a_refit_are_never_found_by_the_new_weights(tiny_llama, monkeypatch):
    """The device prefix cache too: only the prompt's blocks of the new weights are found, never the old
    request's later blocks, although their chain continues from the same tokens."""
    assert computed_across_a_refit(tiny_llama) == 2 * BLOCK
    from megatron_serve.engine.kv import blocks  # noqa: PLC0415

    monkeypatch.setattr(blocks, "epoch_root", lambda root, epoch: root)  # the control: keys without the epoch
    assert computed_across_a_refit(tiny_llama) == 5 * BLOCK  # the old weights' blocks served to the new ones


class HeldCopier(Copier):
    """Copies at once but reports copies to the device as in flight until ``land()``: the pinning seam."""

    def __init__(self):
        self.held: list[_Held] = []

    def to_device(self, host, slots, pool, blocks):
        super().to_device(host, slots, pool, blocks)
        held = _Held()
        self.held.append(held)
        return held

    def land(self):
        for held in self.held:
            held.landed = True


class _Held:
    landed = False

    def done(self) -> bool:
        return self.landed

    def seconds(self) -> float:
        return 0.0


def test_lru_order_and_pins_while_a_load_is_in_flight():
    pool = KVCachePool(2, 8, 4, 1, 2, torch.float32, "cpu")
    for block in range(8):
        pool.block_tensors()[0][:, :, block] = float(block)
    copier = HeldCopier()
    tier = HostKVTier(pool, 2 * pool.bytes_per_pool_block, copier)
    assert tier.num_slots == 2
    assert tier.store([(0, 100), (1, 101)]) == 2
    slots = tier.take([100])  # pinned: a load of it is about to start
    tier.load(slots, [5])
    assert torch.equal(pool.block_tensors()[0][:, :, 5], torch.zeros_like(pool.block_tensors()[0][:, :, 5]))
    assert tier.store([(2, 102)]) == 1  # the least recently used unpinned slot goes: 101's, not 100's
    assert 100 in tier and 101 not in tier and 102 in tier
    tier.load(tier.take([102]), [7])  # now both are being read from
    assert tier.store([(3, 103)]) == 0  # nothing may be overwritten
    copier.land()
    assert tier.store([(3, 103)]) == 1 and 103 in tier  # 100's load landed: its slot is free to reuse

    held = tier.take([103])
    tier.load(held, [6])  # in flight while a refit empties the tier: its slot is not reused until it lands
    tier.clear()
    assert tier.num_cached == 0 and 103 not in tier
    # the one slot not being read from; 201 must not take 200's slot within the same copy
    assert tier.store([(0, 200), (1, 201)]) == 1 and 200 in tier and 201 not in tier
    copier.land()
    assert tier.store([(1, 201)]) == 1 and tier.num_cached == 2

    allocator = BlockAllocator(4, enable_prefix_caching=True, tier=tier)
    table = allocator.allocate(2)
    allocator.register(table[0], 7)
    allocator.free(table)
    allocator.allocate(4)  # evicts the cached block: its contents are copied to the tier under its hash first
    assert 7 in tier


def test_a_full_host_tier_lets_a_worse_band_s_block_go_before_an_older_block_of_a_better_band():
    """The host tier evicts as the device pool does: the worst band first, least recently used within a band; the
    pool hands each evicted block's band over."""
    pool = KVCachePool(2, 1, 4, 1, 2, torch.float32, "cpu")
    tier = HostKVTier(pool, 2 * pool.bytes_per_pool_block)
    allocator = BlockAllocator(1, enable_prefix_caching=True, tier=tier)
    for block_hash, band in ((100, BANDS["critical"]), (101, BANDS["sheddable"]), (102, STANDARD_BAND)):
        (block,) = allocator.allocate(1, band)  # evicts the block cached before it to the tier
        allocator.register(block, block_hash)
        allocator.free([block])
    allocator.allocate(1)  # 102 leaves the pool into a full tier: the sheddable 101 makes room, not the older 100
    assert 100 in tier and 101 not in tier and 102 in tier
    tier.store([(0, 103)], [BANDS["critical"]])  # no worse band left: the standard 102
    assert 100 in tier and 102 not in tier
    tier.store([(0, 104)], [BANDS["critical"]])  # within one band, the least recently used
    assert 100 not in tier and 103 in tier and 104 in tier


@pytest.mark.parametrize("size", [0, -1.0, True, "1"])
def test_bad_sizes_are_refused_naming_the_field(size):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        InferenceConfig(kv_offloading_size=size)


def test_a_tier_without_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="kv_offloading_size needs enable_prefix_caching"):
        InferenceConfig(kv_offloading_size=1.0, enable_prefix_caching=False)


def test_vllm_s_keyword_and_flag_set_the_tier_and_bad_values_name_them():
    assert parse_llm_keywords({"kv_offloading_size": 2}).config == {"kv_offloading_size": 2.0}
    with pytest.raises(ValueError, match="kv_offloading_size=-1"):
        parse_llm_keywords({"kv_offloading_size": -1})
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert parser.parse_args(["--kv-offloading-size", "1.5"]).kv_offloading_size == 1.5
    assert parser.parse_args([]).kv_offloading_size is None and parser.parse_args([]).kv_on_refit == "recompute"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-size", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-on-refit", "later"])


def test_an_engine_process_started_from_python_gets_the_same_tier():
    original = InferenceConfig(device="cpu", kv_offloading_size=0.25, kv_on_refit="keep")
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    rebuilt = inference_config_from_args(parser.parse_args(inference_config_to_argv(original)))
    assert (rebuilt.kv_offloading_size, rebuilt.kv_on_refit) == (0.25, "keep")


@pytest.mark.parametrize("fp8,heads_first", [(False, False), (False, True), (True, False)])
def test_a_block_comes_back_bit_for_bit_in_every_pool_layout(fp8, heads_first):
    """Values (e4m3 with their scales beside them, or heads first as the CPU --batch-invariant pool) round trip."""
    pool = KVCachePool(2, 6, 4, 2, 8, torch.float32, "cpu", fp8=fp8, heads_first=heads_first)
    generator = torch.Generator().manual_seed(0)
    for tensor in pool.block_tensors():
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    before = [t[:, :, 3].clone() for t in pool.block_tensors()]
    tier = HostKVTier(pool, 4 * pool.bytes_per_pool_block)
    assert len(pool.block_tensors()) == (2 if fp8 else 1)
    tier.store([(3, 33)])
    tier.load(tier.take([33]), [5])
    for was, tensor in zip(before, pool.block_tensors()):
        assert torch.equal(tensor[:, :, 5].view(torch.uint8), was.view(torch.uint8))
    assert tier.stats.bytes == {TO_HOST: pool.bytes_per_pool_block, TO_DEVICE: pool.bytes_per_pool_block}
    assert pool.bytes_per_pool_block == KVCachePool.bytes_per_block(2, 4, 2, 8, torch.float32, fp8)


def test_an_fp8_kv_cache_comes_back_from_the_host_tier_bitwise(tiny_llama):
    # batch-invariant, as llm() above: the second pass computes only the rows after the cached prefix, a GEMM of
    # another row count, which the default kernels need not round alike, so equal log probs would prove nothing
    batch = prompts(4)
    served = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=16, max_requests=1,
                                                     max_batch_tokens=256, kv_offloading_size=0.01,
                                                     kv_cache_dtype="fp8", batch_invariant=True))
    first, second = two_passes(served, batch)
    assert [o.generated_log_probs for o in second] == [o.generated_log_probs for o in first]
    assert served.engine.scheduler.host_cached_tokens >= 3 * 5 * BLOCK
