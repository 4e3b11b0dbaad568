"""The paged KV cache: a pool of fixed-size token blocks and the allocator that hands them out.

Blocks carry reference counts so that one block can back several requests (prefix sharing);
a block returns to the free list when its last reference is dropped.
"""

from __future__ import annotations

from collections import deque

import torch


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Reference-counted allocation of block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to a block that is already in use."""
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._ref_counts[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise ValueError(f"block {block} freed twice")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCachePool:
    """Device memory for every layer's keys and values, ``[layers, 2, blocks, block_size, kv_heads, head_dim]``.

    It can be released (suspend) and allocated again (resume) without rebuilding the engine.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self._storage: torch.Tensor | None = None
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_bytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()

    @property
    def allocated(self) -> bool:
        return self._storage is not None

    def allocate(self) -> None:
        if self._storage is None:
            self._storage = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.layer_caches = [(layer[0], layer[1]) for layer in self._storage]

    def release(self) -> int:
        """Free the pool's memory; returns the bytes released."""
        released = self.num_bytes
        self._storage = None
        self.layer_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released
