"""The paged KV cache: a pool of fixed-size token blocks and the allocator that hands them out.

Blocks carry reference counts so that one block can back several requests (prefix sharing);
a block returns to the free list when its last reference is dropped.
"""

from __future__ import annotations

import math
import mmap
from collections import deque
from typing import TYPE_CHECKING, Protocol

import torch

from ...wire.kv_events import MEDIUM_DEVICE
from ...wire.tenancy import STANDARD_BAND
from .bands import BandedLRU

if TYPE_CHECKING:
    from .events import BlockOrigin, KVEventLog


class OutOfBlocksError(RuntimeError):
    pass


class LowerTier(Protocol):
    """Where the pool's evicted cached blocks go, and what a reset clears below it (the host tier,
    :class:`.offload.HostKVTier`, which builds on this module)."""

    def store(self, evicted: list[tuple[int, int]], bands: list[int] | None = None) -> int: ...

    def clear(self, forget_files: bool = False) -> None: ...


class BlockAllocator:
    """Reference-counted allocation of block ids ``0 .. num_blocks-1``, with an optional prefix cache.

    With prefix caching, a complete block can be registered under its chained content hash. When
    its last reference goes, it is not freed but kept *evictable*: a later request with the same
    prefix takes it back, and allocation reuses evictable blocks least-recently-freed first. Blocks
    are freed children first, so a parent is never evicted before its children.

    Eviction takes the worst band first (``wire.tenancy``: ``sheddable``, then ``standard``, then ``critical``), least
    recently freed first within a band (:mod:`.bands`, the host tier's order too), so that a flood of a worse class
    cannot push out a better class's cached prefix (its system prompt). A block's band is the best band of the requests
    that held it since it was last evictable: every request holding a child holds its parent, so a parent's band is
    never worse than its child's and children still go first. Callers that pass no band (no tenants) put every block in
    ``standard``: plain LRU, as before.

    With a host ``tier`` (:mod:`.offload`), a cached block that is evicted is copied there first, with its band. With an
    event log (:mod:`.events`), every block registered and forgotten is told to it (medium ``GPU``).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False, tier: "LowerTier | None" = None,
                 events: "KVEventLog | None" = None):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = tier
        self.events = events
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: BandedLRU[int] = BandedLRU()  # by band, each least recently freed first
        self._ref_counts = [0] * num_blocks
        self._bands = [STANDARD_BAND] * num_blocks  # the best band holding each block since it was last evictable
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of_hash)

    def allocate(self, count: int, band: int = STANDARD_BAND) -> list[int]:
        """``count`` blocks for a request of ``band``: never-cached ones first, then the evictable ones of the worst
        band, least recently freed first."""
        if count > self.num_free:
            raise OutOfBlocksError(f"asked for {count} KV blocks, {self.num_free} free")
        blocks = []
        evicted: list[tuple[int, int]] = []
        evicted_bands: list[int] = []
        free, ref_counts, bands, evictable = self._free, self._ref_counts, self._bands, self._evictable
        for _ in range(count):
            if free:
                block = free.popleft()
            else:
                block = evictable.pop()
                block_hash = self._hash_of_block.pop(block)
                del self._block_of_hash[block_hash]
                evicted.append((block, block_hash))
                evicted_bands.append(bands[block])
            ref_counts[block] = 1
            bands[block] = band
            blocks.append(block)
        if evicted:
            if self.tier is not None:
                self.tier.store(evicted, evicted_bands)
            if self.events is not None:
                self.events.removed(MEDIUM_DEVICE, [block_hash for _, block_hash in evicted])
        return blocks

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; pass a block table as is (it is released children first)."""
        ref_counts, cached, bands, evictable = self._ref_counts, self._hash_of_block, self._bands, self._evictable
        for block in reversed(blocks):
            count = ref_counts[block]
            if count <= 0:
                raise ValueError(f"block {block} freed twice")
            ref_counts[block] = count - 1
            if count == 1:
                if block in cached:
                    evictable.add(block, bands[block])
                else:
                    self._free.append(block)

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks holding the longest prefix of ``hashes``."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int], band: int = STANDARD_BAND) -> None:
        """Take a reference to cached blocks found by ``lookup`` (reviving evictable ones) for a request of
        ``band``."""
        bands = self._bands
        for block in blocks:
            if self._ref_counts[block] == 0:
                self._evictable.remove(block, bands[block])
                bands[block] = band
            elif band < bands[block]:
                bands[block] = band
            self._ref_counts[block] += 1

    def register(self, block: int, block_hash: int, origin: "BlockOrigin | None" = None) -> None:
        """Publish a computed, complete block under its hash (first writer wins); ``origin`` (its chain parent,
        tokens and adapter) is what the KV events say of it."""
        if self.enable_prefix_caching and block_hash not in self._block_of_hash and block not in self._hash_of_block:
            self._block_of_hash[block_hash] = block
            self._hash_of_block[block] = block_hash
            if self.events is not None:
                self.events.stored(MEDIUM_DEVICE, block_hash, origin)

    def blocks_in_use(self) -> list[int]:
        """The blocks some request holds."""
        return [block for block, count in enumerate(self._ref_counts) if count > 0]

    def evictable_blocks(self) -> list[tuple[int, int]]:
        """``(block, hash)`` of the cached blocks no request holds, in eviction order: the worst band first, least
        recently freed first within one."""
        return [(block, self._hash_of_block[block]) for block in self._evictable]

    def bands_of(self, blocks: list[tuple[int, int]]) -> list[int]:
        """The band of each ``(block, hash)`` (what the host tier keeps them under)."""
        return [self._bands[block] for block, _ in blocks]

    def drop_evictable(self) -> None:
        """Forget the cached blocks no request holds (their contents are about to be lost); blocks in use keep
        their hashes."""
        dropped = [self._hash_of_block.pop(block) for block in self._evictable]
        for block_hash in dropped:
            del self._block_of_hash[block_hash]
        self._release_evictable()
        if self.events is not None:
            self.events.removed(MEDIUM_DEVICE, dropped)

    def clear_cache(self) -> None:
        """Forget every cached hash (the pool's contents are gone or stale); blocks in use stay in use."""
        if self.events is not None:
            self.events.removed(MEDIUM_DEVICE, list(self._block_of_hash))
        self._release_evictable()
        self._hash_of_block.clear()
        self._block_of_hash.clear()

    def _release_evictable(self) -> None:
        self._free.extend(self._evictable)
        self._evictable.clear()

    def reset(self, forget_files: bool = False) -> None:
        """Forget every cached block in every tier (a refit: none of them can be found again): AllBlocksCleared.
        ``forget_files``: a prefix-cache reset, which also removes the disk tier's files of the current epoch."""
        self.clear_cache()
        if self.tier is not None:
            self.tier.clear(forget_files)
        if self.events is not None:
            self.events.cleared()  # says it all: the removals just told are dropped unsent


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on a CPU in private anonymous memory, which the kernel hands over zeroed page by page
    as it is first touched: ``torch.zeros`` writes every page up front (0.55 CPU-s for the default 0.9 GiB pool of a
    tiny model, most of which a run never touches)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: a fork copies on write
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)  # the tensor holds the mapping


class KVCachePool:
    """Device memory for every layer's keys and values, ``[layers, 2, blocks, block_size, kv_heads, head_dim]``.

    With ``fp8`` the values are e4m3 and a float32 scale per token and head sits beside them
    (``[layers, 2, blocks, block_size, kv_heads]``): a layer's cache is then ``(k, v, k_scales,
    v_scales)`` instead of ``(k, v)``, and a block takes ``head_dim + 4`` bytes per token and head
    instead of ``2 * head_dim`` (bf16): 1.94x the tokens at head_dim 128, 1.88x at 64.
    It can be released (suspend) and allocated again (resume) without rebuilding the engine.

    With ``heads_first`` (every pool on a CPU) the memory is ordered ``[layers, 2, kv_heads, blocks, block_size,
    head_dim]`` and each layer's cache is a view of it with the usual shape: the CPU attention (the reference
    kernels, and :class:`megatron_kernels.invariant_attention.PagedStep` under ``--batch-invariant``) reads a
    sequence's keys per head as whole blocks, one contiguous copy per (head, block) instead of one per token and
    head; every indexing reader works unchanged.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, fp8: bool = False, heads_first: bool = False,
                 first_layer: int = 0):
        """``first_layer``: a pipeline stage's pool holds its ``num_layers`` layers from that one on; the layers
        before it have no cache here (``layer_caches`` keeps the decoder's layer indices)."""
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.first_layer = first_layer
        self.dtype = torch.float8_e4m3fn if fp8 else dtype
        self.fp8 = fp8
        self.heads_first = heads_first
        self.device = torch.device(device)
        self._storage: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self.layer_caches: list[tuple[torch.Tensor, ...]] = []
        self.allocate()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        fp8: bool = False) -> int:
        per_value = head_dim + 4 if fp8 else head_dim * torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * per_value

    def block_tensors(self) -> list[torch.Tensor]:
        """The pool's tensors, each with the block as its dim 2 (values; with fp8 their scales too)."""
        return [t for t in (self._storage, self._scales) if t is not None]

    def block_layout(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each of :meth:`block_tensors`' dtype and the shape of one block of it (dim 2 taken out): what a block's
        copy in host memory, or on its way to another engine, holds."""
        return [(t.dtype, (*t.shape[:2], *t.shape[3:])) for t in self.block_tensors()]

    @property
    def bytes_per_pool_block(self) -> int:
        """Bytes of one block across every layer (values and, with fp8, scales)."""
        layers, kinds, _blocks, block_size, heads, dim = self.shape
        per_value = dim * self.dtype.itemsize + (4 if self.fp8 else 0)
        return layers * kinds * block_size * heads * per_value

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._storage, self._scales) if t is not None)

    def allocate(self) -> None:
        if self._storage is None:
            if self.heads_first:
                layers, kinds, blocks, block_size, heads, dim = self.shape
                self._storage = _zeros((layers, kinds, heads, blocks, block_size, dim), self.dtype,
                                       self.device).permute(0, 1, 3, 4, 2, 5)
            else:
                self._storage = _zeros(self.shape, self.dtype, self.device)
            self.layer_caches = [(layer[0], layer[1]) for layer in self._storage]
            if self.fp8:
                self._scales = _zeros(self.shape[:-1], torch.float32, self.device)
                self.layer_caches = [(*cache, scales[0], scales[1])
                                     for cache, scales in zip(self.layer_caches, self._scales)]
            self.layer_caches = [()] * self.first_layer + self.layer_caches

    def release(self) -> int:
        """Free the pool's memory; returns the bytes released."""
        released = self.num_bytes
        self._storage = self._scales = None
        self.layer_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released
