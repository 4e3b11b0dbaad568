"""The eviction order of cached KV blocks by priority band, shared by the device prefix cache and the host tier.

Eviction takes the worst band first (``wire.tenancy``: ``sheddable``, then ``standard``, then ``critical``), least
recently used first within a band, so that a flood of a worse class cannot push out a better class's cached prefix
(its system prompt) from either tier. Callers that give no band (no tenants) put every key in ``standard``: plain LRU.
The caller keeps each key's band (the allocator has it per block already): the order stores none, which keeps the
allocator's hot path at a dict operation per block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterator, TypeVar

from ...wire.tenancy import CLASSES

K = TypeVar("K", bound=Hashable)


class BandedLRU(Generic[K]):
    """Keys (device blocks, block hashes) by band, each band least recently used first (see the module docstring)."""

    __slots__ = ("_bands", "_worst_first")

    def __init__(self) -> None:
        self._bands: tuple[OrderedDict[K, None], ...] = tuple(OrderedDict() for _ in CLASSES)
        self._worst_first = self._bands[::-1]

    def __len__(self) -> int:
        return sum(map(len, self._bands))

    def __iter__(self) -> Iterator[K]:
        """The keys in eviction order: the worst band first, least recently used first within one."""
        for band in self._worst_first:
            yield from band

    def add(self, key: K, band: int) -> None:
        """Put ``key``, in no band yet, in ``band`` as its most recently used."""
        self._bands[band][key] = None

    def touch(self, key: K, band: int) -> None:
        """Mark ``key`` of ``band`` used now."""
        self._bands[band].move_to_end(key)

    def remove(self, key: K, band: int) -> None:
        del self._bands[band][key]

    def pop(self) -> K:
        """Take the next key to evict out (there must be one)."""
        for band in self._worst_first:
            if band:
                return band.popitem(last=False)[0]
        raise KeyError("pop from an empty BandedLRU")

    def clear(self) -> None:
        for band in self._bands:
            band.clear()
