"""The host tier of the KV cache (``--kv-offloading-size``): a second, larger cache of complete blocks in host memory.

A cached block leaves the device pool when the allocator evicts it to make room (or when ``suspend`` releases
the pool); with a tier, its contents are copied to a host slot first, under the same chained hash. A prefix
lookup that stops on the device goes on in the tier, and the blocks found there are copied back into freshly
allocated device blocks instead of being recomputed. The tier is a victim cache: it holds what the device pool
let go, so the two together cache more than either.

The hash is the whole identity of a block. Its chain starts from the request's cache salt, its LoRA
registration (each version of an adapter is its own registration) and the weights' epoch
(:func:`~megatron_serve.wire.prefix_hash.epoch_root`), so a block computed under old weights or an old adapter
version is never found by a request of the new ones, in either tier; a refit also empties the tier, since
nothing in it can be found again.

Slots are reused by the device pool's rule (:mod:`.bands`): the worst priority band first, least recently used first
within a band (a block keeps the band the pool evicted it with; one read from disk is ``standard``). A slot whose copy
back to the device has not completed is pinned and never reused. With a disk tier behind it (:mod:`.disk`,
``--kv-offloading-backend disk``) the block of a slot being reused is written to the node's disk, and a lookup that
stops in host memory goes on there: a block found on disk is read into a host slot and copied to the device as any host
hit. Neither waits on the step thread (:mod:`.disk_io`): a spill copies the block out and queues its write; a lookup
that finds blocks on disk starts their reads and answers "not yet" (:meth:`HostKVTier.take` returns None), the request
waits in the queue while others step, and the same lookup after the reads landed finds them in host memory. The slots
found or being read for a waiting request are held for it until it looks again or leaves. The copies between the pool
and the slots are a :class:`~.copier.Copier`'s (:mod:`.copier`).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ALL_COMPLETED, Future, wait as wait_futures
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...config import InferenceConfig
from ...wire.engine_stats import KV_DISK, KV_OFFLOAD, KV_OFFLOAD_DIRECTIONS
from ...wire.kv_events import MEDIUM_HOST
from ...wire.tenancy import STANDARD_BAND
from .bands import BandedLRU
from .cache import KVCachePool
from .copier import Copier, CudaCopier, Transfer, copier_for
from .disk import DiskKVTier, layout_key
from .disk_io import DiskIO, write_depth
from .events import KVEventLog

#: vLLM's ``transfer_type`` label values of ``vllm:kv_offload_total_bytes`` and ``vllm:kv_offload_total_time``.
TO_HOST, TO_DEVICE = KV_OFFLOAD_DIRECTIONS


@dataclass
class _Read:
    """A disk read into a host slot, started under the tier's ``generation`` (a clear ends a generation)."""

    block_hash: int
    slot: int
    future: Future
    generation: int


@dataclass
class TransferStats:
    """Cumulative bytes and seconds per direction (vLLM's ``kv_offload_total_bytes`` / ``_time``); the tokens
    found in the tier are counted where requests are admitted (the scheduler's ``host_cached_tokens``)."""

    bytes: dict[str, int] = field(default_factory=lambda: {TO_HOST: 0, TO_DEVICE: 0})
    seconds: dict[str, float] = field(default_factory=lambda: {TO_HOST: 0.0, TO_DEVICE: 0.0})

    def to_wire(self) -> dict[str, dict[str, float]]:
        return {direction: {"bytes": self.bytes[direction], "seconds": self.seconds[direction]}
                for direction in (TO_HOST, TO_DEVICE)}


def host_buffers(pool: KVCachePool, num_slots: int, pin_memory: bool) -> list[torch.Tensor]:
    """Host memory for ``num_slots`` blocks of ``pool``: per pool tensor, ``[slots, *block shape]``."""
    return [torch.empty((num_slots, *shape), dtype=dtype, pin_memory=pin_memory)
            for dtype, shape in pool.block_layout()]


class HostKVTier:
    """Complete KV blocks in host memory, by chained hash, the worst band's least recently used first out (see the
    module docstring). ``capacity_bytes`` of host memory, in whole blocks of ``pool``'s layout."""

    def __init__(self, pool: KVCachePool, capacity_bytes: int, copier: Copier | None = None,
                 events: KVEventLog | None = None):
        self.pool = pool
        self.disk: DiskKVTier | None = None  # behind this tier (attach_disk)
        self.disk_io: DiskIO | None = None  # its reads and writes, off the step thread
        self.events = events  # told what the tier stores and drops (medium ``CPU``)
        self.copier = copier if copier is not None else copier_for(pool.device)
        self.block_bytes = pool.bytes_per_pool_block
        self.num_slots = int(capacity_bytes) // self.block_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_offloading_size holds no KV block: one takes {self.block_bytes} bytes, "
                             f"{int(capacity_bytes)} were given")
        self._host = host_buffers(pool, self.num_slots, self.copier.pin_memory)
        self._slot_of_hash: dict[int, int] = {}
        self._order: BandedLRU[int] = BandedLRU()  # the hashes here, in eviction order (by band, then LRU)
        self._band_of_hash: dict[int, int] = {}
        self._hash_of_slot: dict[int, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}  # slot -> copies to the device in flight from it
        self._loads: list[tuple[Transfer, list[int]]] = []
        self._reads: dict[int, _Read] = {}  # hash -> its disk read in flight, of this generation
        self._landing: list[_Read] = []  # every disk read in flight (a clear leaves earlier ones landing)
        self._reading_slots: set[int] = set()  # slots a disk read fills: out of use until it lands
        self._writes: dict[int, Future] = {}  # hash -> its disk write in flight: a lookup waits for it, not misses
        self._holds: dict[str | None, list[int]] = {}  # a waiting request's slots, kept for its next lookup
        self._held: Counter[int] = Counter()
        self._generation = 0
        self._stores: list[Transfer] = []
        self.stats = TransferStats()

    @classmethod
    def sized(cls, pool: KVCachePool, config: InferenceConfig, events: KVEventLog | None = None,
              copier: Copier | None = None) -> "HostKVTier | None":
        """The tier ``--kv-offloading-size`` asks for (None: no tier): that many GiB for the whole group, as vLLM
        counts it, each tensor-parallel rank or pipeline stage holding its share for its part of every block."""
        gib, ranks = config.kv_offloading_size, config.tensor_parallel_size * config.pipeline_parallel_size
        return cls(pool, int(gib * 2**30) // ranks, copier, events) if gib else None

    def attach_disk(self, directory: str, capacity_bytes: int, model_identity: str,
                    epoch: Callable[[], int]) -> DiskKVTier:
        """Put the node's disk tier behind this one (``--kv-offloading-backend disk``)."""
        rows = [buffer[0] for buffer in self._host]
        self.disk = DiskKVTier(directory, capacity_bytes, layout_key(model_identity, rows), self.block_bytes, epoch,
                               self.events)
        self.disk_io = DiskIO(self.disk, rows, write_depth(self.block_bytes, self.num_slots))
        return self.disk

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def report(self, snapshot: dict, queried_tokens: int, hit_tokens: int) -> None:
        """Add the tier's series to an engine's heartbeat ``metrics`` (:mod:`megatron_serve.wire.engine_stats`):
        the tokens admitted requests looked up here and found here, and the copies' bytes and seconds; with a disk
        tier, its counts."""
        snapshot["counters"].update(external_prefix_cache_queries=queried_tokens, external_prefix_cache_hits=hit_tokens)
        snapshot[KV_OFFLOAD] = self.stats.to_wire()
        if self.disk_io is not None:
            snapshot[KV_DISK] = self.disk_io.to_wire()

    @property
    def num_cached(self) -> int:
        return len(self._slot_of_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of_hash

    def _reap(self) -> None:
        """Account for copies that completed, and unpin the slots of loads that landed."""
        still: list[tuple[Transfer, list[int]]] = []
        for transfer, slots in self._loads:
            if not transfer.done():
                still.append((transfer, slots))
                continue
            self.stats.seconds[TO_DEVICE] += transfer.seconds()
            for slot in slots:
                self._pins[slot] -= 1
                if not self._pins[slot]:
                    del self._pins[slot]
                    self._release(slot)  # free if clear() forgot its block while it was loaded from
        self._loads = still
        pending = []
        for transfer in self._stores:
            if transfer.done():
                self.stats.seconds[TO_HOST] += transfer.seconds()
            else:
                pending.append(transfer)
        self._stores = pending

    def _release(self, slot: int) -> None:
        """Free ``slot`` if nothing uses it any more: no block, no copy, no hold, no disk read."""
        if (slot not in self._hash_of_slot and slot not in self._pins and not self._held[slot]
                and slot not in self._reading_slots):
            self._free.append(slot)

    def _land(self) -> None:
        """Tell the events what the disk did; land the disk reads that are done (a sound block joins the tier, a
        missing or bad one, or one of a generation that a clear ended, frees its slot); forget finished writes."""
        if self.disk is None:
            return
        self.disk.announce()
        still: list[_Read] = []
        for read in self._landing:
            if not read.future.done():
                still.append(read)
                continue
            self._reading_slots.discard(read.slot)
            found = read.future.result()
            if read.generation == self._generation:
                del self._reads[read.block_hash]
                if found is not None:  # its band is not on disk: standard
                    self._slot_of_hash[read.block_hash] = read.slot
                    self._keep(read.block_hash, STANDARD_BAND)
                    self._hash_of_slot[read.slot] = read.block_hash
                    if self.events is not None:
                        self.events.stored(MEDIUM_HOST, read.block_hash, found.origin)
                    continue
            self._release(read.slot)
        self._landing = still
        self._writes = {block_hash: write for block_hash, write in self._writes.items() if not write.done()}

    def _take_slot(self, filling: set[int]) -> int | None:
        """A free slot, else the first in eviction order (the worst band's least recently used) neither pinned, held
        nor being filled by the same copy (its block forgotten); None when there is none."""
        if self._free:
            return self._free.pop()
        for block_hash in self._order:
            slot = self._slot_of_hash[block_hash]
            if slot not in self._pins and slot not in filling and not self._held[slot]:
                if self.disk is not None:
                    self._spill(block_hash, slot)
                del self._slot_of_hash[block_hash]
                self._order.remove(block_hash, self._band_of_hash.pop(block_hash))  # the iteration ends here
                del self._hash_of_slot[slot]
                if self.events is not None:
                    self.events.removed(MEDIUM_HOST, [block_hash])
                return slot
        return None

    def _keep(self, block_hash: int, band: int) -> None:
        """Put ``block_hash`` in ``band``, as its most recently used (the band of its latest holders, as the pool
        counts a block's band since it was last evictable)."""
        previous = self._band_of_hash.get(block_hash)
        if previous is not None:
            self._order.remove(block_hash, previous)
        self._order.add(block_hash, band)
        self._band_of_hash[block_hash] = band

    def _slot_rows(self, slot: int) -> list[torch.Tensor]:
        return [buffer[slot] for buffer in self._host]

    def _spill(self, block_hash: int, slot: int) -> None:
        """Queue a slot's block for the disk tier before the slot is reused (its copy from the device landed first;
        the write copies the bytes out): dropped when the write queue is full."""
        if self._stores:
            self.wait()
        origin = self.events.origin(block_hash) if self.events else None
        write = self.disk_io.spill(block_hash, self._slot_rows(slot), origin, self.disk.epoch())
        if write is not None:
            self._writes[block_hash] = write

    def _start_read(self, block_hash: int, filling: set[int]) -> int | None:
        """The slot a disk read of ``block_hash`` fills: one in flight, or one started now; None when the disk has
        no file of it or there is no slot for it."""
        read = self._reads.get(block_hash)
        if read is not None:
            return read.slot
        if not self.disk.has(block_hash):
            return None
        slot = self._take_slot(filling)
        if slot is None:
            return None
        future = self.disk_io.read(block_hash, self._slot_rows(slot), self.disk.epoch())
        self._reads[block_hash] = read = _Read(block_hash, slot, future, self._generation)
        self._landing.append(read)
        self._reading_slots.add(slot)
        return slot

    def store(self, evicted: list[tuple[int, int]], bands: list[int] | None = None) -> int:
        """Copy the device blocks ``(block, hash)`` leaving the pool to host slots (those already here are only
        marked recently used), each under its priority band (``bands``, the pool's; None: all ``standard``), which
        orders the tier's eviction as the pool's (:mod:`.bands`); returns how many were copied."""
        self._reap()
        self._land()
        blocks, slots = [], []
        filling: set[int] = set()
        for index, (block, block_hash) in enumerate(evicted):
            band = bands[index] if bands is not None else STANDARD_BAND
            if block_hash in self._slot_of_hash:
                self._keep(block_hash, band)
                continue
            slot = self._take_slot(filling)
            if slot is None:
                break
            filling.add(slot)
            self._slot_of_hash[block_hash] = slot
            self._keep(block_hash, band)
            self._hash_of_slot[slot] = block_hash
            blocks.append(block)
            slots.append(slot)
            if self.events is not None:
                self.events.stored(MEDIUM_HOST, block_hash)
        if blocks:
            self._stores.append(self.copier.to_host(self.pool, blocks, self._host, slots))
            self.stats.bytes[TO_HOST] += len(blocks) * self.block_bytes
            self._reap()
        return len(blocks)

    def take(self, hashes: list[int], owner: str | None = None) -> list[int] | None:
        """The slots holding the longest prefix of ``hashes``, pinned until :meth:`load` copies them back; None
        (not yet) while some of them are on their way from disk: the reads run, and the slots found so far are held
        for ``owner`` (a request) until its next call or :meth:`release`."""
        self._reap()
        self._land()
        slots: list[int] = []
        waiting = False
        for block_hash in hashes:
            slot = self._slot_of_hash.get(block_hash)
            if slot is not None:
                self._order.touch(block_hash, self._band_of_hash[block_hash])
            elif self.disk is not None:
                if block_hash in self._writes:  # its file is not there yet: the lookup comes back once it is
                    waiting = True
                    break
                slot = self._start_read(block_hash, set(slots))
                waiting = waiting or slot is not None
            if slot is None:
                break
            slots.append(slot)
        previous = self._holds.pop(owner, [])
        if waiting:
            self._holds[owner] = slots
            self._held.update(slots)
        else:
            for slot in slots:
                self._pins[slot] = self._pins.get(slot, 0) + 1
        self._unhold(previous)
        return None if waiting else slots

    def release(self, owner: str | None) -> None:
        """Let go of the slots held for ``owner`` (a request that left while its blocks were read)."""
        self._unhold(self._holds.pop(owner, []))

    def _unhold(self, slots: list[int]) -> None:
        for slot in slots:
            self._held[slot] -= 1
            if not self._held[slot]:
                del self._held[slot]
                self._release(slot)

    def reading(self) -> bool:
        """Whether disk reads or writes that a lookup may wait for are in flight."""
        return bool(self._reads or self._writes)

    def await_disk(self, timeout: float) -> None:
        """Block until the disk reads and writes in flight are done, at most ``timeout`` seconds (a step with nothing
        to run but requests waiting for their blocks: the engine waits here rather than spin, and for all of them,
        as a request needs its whole prefix: one lookup again, not one per block)."""
        pending = [read.future for read in self._reads.values()] + list(self._writes.values())
        if pending:
            wait_futures(pending, timeout, ALL_COMPLETED)

    def announce(self) -> None:
        """Hand the event log what the disk did since the last lookup or store (an idle engine calls this: its
        "stored on disk" events would otherwise wait for the next request)."""
        self._land()

    def flush(self) -> None:
        """Wait until every block spilled so far is written (a reset removes files; a test or a benchmark reads
        what was written)."""
        if self.disk_io is not None:
            self.disk_io.flush()
            self._land()

    def load(self, slots: list[int], blocks: list[int]) -> None:
        """Copy the slots :meth:`take` pinned into device ``blocks``; each slot stays pinned until its copy lands."""
        if not slots:
            return
        self._loads.append((self.copier.to_device(self._host, slots, self.pool, blocks), slots))
        self.stats.bytes[TO_DEVICE] += len(slots) * self.block_bytes
        self._reap()

    def clear(self, forget_files: bool = False) -> None:
        """Forget every block (a refit: none of them can be found again); a slot still being loaded from returns
        to use once its copy lands. ``forget_files`` (a prefix-cache reset) also removes the disk tier's files of
        the current epoch; a refit leaves them, unreachable under the new epoch's keys."""
        self._reap()
        if forget_files and self.disk is not None:
            self.flush()  # no write queued before the reset lands after it
            self.disk.forget()
        self._land()
        if self.events is not None:
            self.events.removed(MEDIUM_HOST, list(self._slot_of_hash))
        self._slot_of_hash.clear()
        self._order.clear()
        self._band_of_hash.clear()
        self._hash_of_slot.clear()
        self._generation += 1  # the reads in flight land into nothing
        self._reads.clear()
        self._holds.clear()
        self._held.clear()
        self._free = [slot for slot in range(self.num_slots - 1, -1, -1)
                      if slot not in self._pins and slot not in self._reading_slots]

    def wait(self) -> None:
        """Block until every copy has landed (before the pool is released or read by the host)."""
        if isinstance(self.copier, CudaCopier):
            self.copier.stream.synchronize()
        self._reap()

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop its threads (the engine shuts down; again: nothing)."""
        if self.disk_io is not None:
            self.disk_io.close()
            self.disk.close()
            self.disk_io = None
