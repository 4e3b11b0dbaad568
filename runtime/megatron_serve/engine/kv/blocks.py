"""Each request's KV blocks, as the scheduler asks for them (vLLM v1's ``KVCacheManager`` role): how many more a
step needs and taking them, the longest cached prefix a new request starts on (the device's prefix cache, then the
host tier's), publishing the blocks a step completed, and letting a request's blocks go.

The scheduler decides who runs and how many tokens; this decides which blocks that takes. Every block is taken for
its request's band (:func:`~..tenancy.base_band`), so that the prefix cache evicts the worst band's blocks first.
"""

from __future__ import annotations

from ...wire.prefix_hash import block_hashes, chain_hash, epoch_root
from ..sequence import Sequence
from ..tenancy import base_band
from .cache import BlockAllocator, blocks_for_tokens
from .events import BlockOrigin

#: What :meth:`SequenceBlocks.attach_cached_prefix` says of a sequence whose blocks are being read from disk (no
#: hash is below 0).
READING = -1


def block_adapter(sequence: Sequence) -> tuple[int, str] | None:
    """The adapter a sequence's blocks are computed under, as KV events name it: (version, name); None: base."""
    name = sequence.sampling_params.lora_name
    return None if sequence.lora_slot < 0 or name is None else (sequence.lora_version, name)


class SequenceBlocks:
    """The blocks of the scheduler's sequences, over the engine's :class:`~.cache.BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size

    def needed(self, sequence: Sequence, num_tokens: int) -> int:
        """Blocks ``sequence`` lacks to compute ``num_tokens`` more."""
        return blocks_for_tokens(sequence.num_computed + num_tokens, self.block_size) - len(sequence.block_table)

    def fit(self, sequence: Sequence, num_tokens: int) -> bool:
        """Whether the free blocks cover ``num_tokens`` more of ``sequence``."""
        return self.needed(sequence, num_tokens) <= self.allocator.num_free

    def grow(self, sequence: Sequence, num_tokens: int) -> None:
        """Take the blocks ``num_tokens`` more of ``sequence`` need (they must fit)."""
        needed = self.needed(sequence, num_tokens)
        if needed > 0:
            sequence.block_table.extend(self.allocator.allocate(needed, base_band(sequence)))

    def release(self, sequence: Sequence) -> None:
        """Drop a sequence's blocks; it must be recomputed from scratch to run again."""
        self.allocator.free(sequence.block_table)
        sequence.block_table = []
        sequence.block_hashes = []
        sequence.prompt_hashes = []
        sequence.num_computed = 0
        sequence.host_tokens = 0
        sequence.kv_epoch = None

    def attach_cached_prefix(self, sequence: Sequence, epoch: int) -> int | None:
        """Start a sequence on the longest cached chain of its blocks, under the weights' ``epoch``.

        Returns the hash of its first block that is not cached (None when all shareable blocks are;
        :data:`READING` while some are on their way from disk). The last token is always computed (its logits are
        needed), so it is never matched. A request that still needs prompt log probs reads nothing from the cache:
        the positions it would skip must be scored (vLLM's choice too); it still publishes its blocks for others.
        A request that records its expert routing reads nothing either (its routing must be its own).
        """
        allocator, size = self.allocator, self.block_size
        if (not allocator.enable_prefix_caching or sequence.num_computed or not sequence.reads_prefix_cache
                or sequence.prompt_scores_missing or epoch < 0):  # -1: a mix of weights, nothing shared
            return None
        cacheable = (len(sequence.token_ids) - 1) // size
        sequence.prompt_hashes = hashes = block_hashes(sequence.cache_tokens(0, cacheable * size), size,
                                                       epoch_root(sequence.prefix_root, epoch))
        band = base_band(sequence)
        blocks = allocator.lookup(hashes)
        allocator.acquire(blocks, band)
        on_device = len(blocks)
        tier = allocator.tier
        if tier is not None and on_device < cacheable:
            slots = tier.take(hashes[on_device : on_device + allocator.num_free], sequence.request_id)
            if slots is None:  # some are on their way from disk (kv.offload): it waits, and others step
                allocator.free(blocks)
                return READING
            if slots:
                loaded = allocator.allocate(len(slots), band)
                tier.load(slots, loaded)
                for block, block_hash in zip(loaded, hashes[on_device:]):
                    allocator.register(block, block_hash)
                blocks += loaded
                sequence.host_tokens = len(slots) * size
        if blocks:
            sequence.block_table = list(blocks)
            sequence.block_hashes = hashes[: len(blocks)]
            sequence.num_computed = len(blocks) * size
        return hashes[len(blocks)] if len(blocks) < cacheable else None

    def register_computed(self, sequence: Sequence, epoch: int) -> None:
        """Publish the sequence's newly completed blocks whose tokens the host knows to the prefix cache (drafts
        not verified yet are not known: their rows may be rolled back). ``epoch``: the one served, for a sequence
        whose KV has none of its own."""
        epoch = epoch if sequence.kv_epoch is None else sequence.kv_epoch
        if not self.allocator.enable_prefix_caching or epoch < 0:  # -1: a mix of weights, nothing to share
            return
        size = self.block_size
        known = len(sequence.token_ids) - sequence.num_drafts - sequence.drafts_in_flight
        told = self.allocator.events is not None
        for index in range(len(sequence.block_hashes), min(sequence.num_computed, known) // size):
            parent = sequence.block_hashes[-1] if sequence.block_hashes else epoch_root(sequence.prefix_root, epoch)
            tokens = sequence.cache_tokens(index * size, (index + 1) * size)
            block_hash = chain_hash(parent, tokens)
            sequence.block_hashes.append(block_hash)
            origin = BlockOrigin(parent if index else None, tuple(tokens), block_adapter(sequence)) if told else None
            self.allocator.register(sequence.block_table[index], block_hash, origin)
