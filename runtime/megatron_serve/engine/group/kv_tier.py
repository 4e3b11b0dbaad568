"""The host KV tier (:mod:`..kv.offload`) in a group: every rank holds its part of each block (its heads under tensor
parallelism, its layers under pipeline parallelism), so a block that leaves the device pool, or comes back to it,
moves on every rank at once.

Rank 0's tier decides alone (which block, which slot: its allocator is the group's), and its :class:`GroupCopier`
tells the other ranks each copy before making its own. The message goes on the plan channel ahead of the step that
depends on it, so a follower makes the copy in the same place in its sequence of steps as rank 0 does
(:class:`FollowerTier`): a block copied out before the step that reuses it, a block copied in before the step that
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from ..kv.cache import KVCachePool
from ..kv.copier import Copier, Transfer, copier_for
from ..kv.offload import host_buffers

Direction = Literal["to_host", "to_device"]


@dataclass(frozen=True)
class KVCopy:
    """One copy of the tier, as rank 0 tells it: its direction, the device blocks, the host slots, and how many
    slots the tier has (a follower sizes its own host memory by it: a block of its part is smaller)."""

    direction: Direction
    blocks: list[int]
    slots: list[int]
    num_slots: int


class GroupCopier(Copier):
    """Rank 0's copies between its pool and its host slots, each told to the group first (``tell``: the plan
    channel's broadcast)."""

    def __init__(self, local: Copier, tell: Callable[[KVCopy], None]):
        self.local = local
        self.tell = tell
        self.pin_memory = local.pin_memory

    def to_host(self, pool: KVCachePool, blocks: list[int], host: list[torch.Tensor], slots: list[int]) -> Transfer:
        self.tell(KVCopy("to_host", list(blocks), list(slots), len(host[0])))
        return self.local.to_host(pool, blocks, host, slots)

    def to_device(self, host: list[torch.Tensor], slots: list[int], pool: KVCachePool, blocks: list[int]) -> Transfer:
        self.tell(KVCopy("to_device", list(blocks), list(slots), len(host[0])))
        return self.local.to_device(host, slots, pool, blocks)


@dataclass
class FollowerTier:
    """A follower's host slots, made at rank 0's first copy, and the copies rank 0 tells it (:class:`KVCopy`)."""

    pool: KVCachePool
    device: torch.device
    copier: Copier = field(init=False)
    host: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.copier = copier_for(self.device)

    def apply(self, copy: KVCopy) -> None:
        if self.host is None:
            self.host = host_buffers(self.pool, copy.num_slots, self.copier.pin_memory)
        if copy.direction == "to_host":
            self.copier.to_host(self.pool, copy.blocks, self.host, copy.slots)
        else:
            self.copier.to_device(self.host, copy.slots, self.pool, copy.blocks)
