"""The host tier's copies on a GPU (``CudaCopier``): ordered after the steps queued before them, and the steps queued
after them ordered after the copies, with neither the host nor the copies waiting on the host.

A step still running on the compute stream is stood in for by ``torch.cuda._sleep`` (the GPU spins for a number of
cycles) followed by a write into the pool: queued before a copy, that write must be what the copy sees (to the host)
or must not land over what the copy wrote (to the device). The side stream is held back the same way to check that
a step queued after a copy to the device reads what it wrote. Without the side stream's wait on the compute stream
the first two fail: the copy runs while the compute stream still spins.
"""

from __future__ import annotations

import pytest
import torch

from megatron_serve.engine.kv.cache import KVCachePool
from megatron_serve.engine.kv.offload import CudaCopier, HostKVTier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the copies run on a "
                                "side stream (benchmarks/gpu_session.sh kvtiers runs this file on one)")

SPIN = 200_000_000  # GPU cycles: about 0.1 s, far longer than a block's copy


def tier() -> tuple[KVCachePool, HostKVTier]:
    pool = KVCachePool(2, 8, 16, 2, 64, torch.float16, "cuda")
    return pool, HostKVTier(pool, 4 * pool.bytes_per_pool_block, CudaCopier(pool.device))


def block(pool: KVCachePool, index: int) -> torch.Tensor:
    return pool.block_tensors()[0][:, :, index]


def test_a_copy_to_the_host_sees_what_the_steps_queued_before_it_wrote():
    pool, host = tier()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # a step still in flight ...
    block(pool, 3).fill_(7.0)  # ... that writes block 3 when it ends
    host.store([(3, 33)])  # the allocator evicts block 3 while that step runs
    host.wait()
    host.load(host.take([33]), [5])
    torch.cuda.synchronize()
    assert torch.equal(block(pool, 5), torch.full_like(block(pool, 5), 7.0))


def test_a_copy_to_the_device_lands_after_the_steps_queued_before_it():
    pool, host = tier()
    block(pool, 1).fill_(3.0)
    host.store([(1, 11)])
    host.wait()
    torch.cuda._sleep(SPIN)  # a step still in flight ...
    block(pool, 6).fill_(9.0)  # ... that writes block 6, freed and handed out again since
    host.load(host.take([11]), [6])
    torch.cuda.synchronize()
    assert torch.equal(block(pool, 6), torch.full_like(block(pool, 6), 3.0))


def test_a_step_queued_after_a_copy_to_the_device_reads_what_it_wrote():
    pool, host = tier()
    block(pool, 2).fill_(5.0)
    host.store([(2, 22)])
    host.wait()
    with torch.cuda.stream(host.copier.stream):
        torch.cuda._sleep(SPIN)  # the side stream is busy: the copy below lands late
    host.load(host.take([22]), [4])
    seen = block(pool, 4).clone()  # the next step, on the compute stream
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full_like(seen, 5.0))
