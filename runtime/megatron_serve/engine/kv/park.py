"""The KV of live requests kept in host memory while the device pool is released (``suspend(keep_kv=True)``).

A plain suspend frees the pool and every request in flight recomputes its prompt and everything it had
generated after ``resume``: for RL, every rollout alive at each weight sync. Keeping the KV copies the blocks
that live requests hold to host memory before the pool goes, and ``resume`` copies them back into the same
block ids: the requests keep their block tables and continue where they stopped, no token computed twice.

The copy is taken whole and dropped on resume: it is not a cache (that is :mod:`.offload`'s host tier), and
its host memory is its own, sized by the blocks in use, not by ``--kv-offloading-size``. In a tensor- or
pipeline-parallel group every rank parks its own part of the blocks (:class:`ParkOrder`) and copies it back, or
drops it, as rank 0 decides at ``resume``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import KVCachePool
from .offload import CudaCopier, copier_for, host_buffers


@dataclass(frozen=True)
class ParkOrder:
    """The blocks a suspend with ``keep_kv`` parks, under the weights' epoch they were computed with. Rank 0 of a
    tensor- or pipeline-parallel group sends it to the other ranks: the block ids are the same on every rank, each
    rank's pool holds its own part of them (its stage's layers, its share of the KV heads)."""

    blocks: list[int]
    epoch: int


@dataclass
class ParkedKV:
    """Blocks ``blocks`` of a pool, in host memory, as they were under weights ``epoch``."""

    blocks: list[int]
    host: list[torch.Tensor]
    epoch: int
    num_bytes: int
    seconds: float  # how long the copy to the host took

    @classmethod
    def park(cls, pool: KVCachePool, blocks: list[int], epoch: int) -> "ParkedKV":
        """Copy ``blocks`` of ``pool`` to host memory and wait for the copy (the pool is released next)."""
        started = time.perf_counter()
        copier = copier_for(pool.device)
        host = host_buffers(pool, len(blocks), copier.pin_memory)
        if blocks:
            copier.to_host(pool, blocks, host, list(range(len(blocks))))
            _wait(copier)
        return cls(blocks, host, epoch, len(blocks) * pool.bytes_per_pool_block, time.perf_counter() - started)

    def restore(self, pool: KVCachePool) -> float:
        """Copy the blocks back into ``pool`` (allocated again, same shape) at their ids; returns seconds."""
        started = time.perf_counter()
        if self.blocks:
            copier = copier_for(pool.device)
            copier.to_device(self.host, list(range(len(self.blocks))), pool, self.blocks)
            _wait(copier)
        return time.perf_counter() - started


def _wait(copier: object) -> None:
    if isinstance(copier, CudaCopier):
        copier.stream.synchronize()
