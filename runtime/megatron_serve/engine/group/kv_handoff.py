"""Prefill/decode disaggregation (:mod:`..kv.transfer`) in a group: every rank holds its part of a prefilled request's
blocks (its heads under tensor parallelism, its layers under pipeline parallelism), so the blocks that go on to a
decode engine are every rank's parts, and a decode group's ranks each take theirs.

Rank 0 speaks for the group (:class:`GroupHandoff`): when a prefilled request leaves, it has the other ranks copy their
parts of its blocks to host memory and gathers them (``KV_BLOCKS`` carries rank 0's tensors, then each other rank's,
in rank order); when a request starts on blocks that arrived, it hands each rank its part to copy in, ahead of the
step that reads them (:class:`~..kv.transfer.OtherRanks`, which a group of one rank has none of).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ...errors import EngineGroupLost
from ..kv.cache import KVCachePool
from ..kv.park import ParkedKV
from ..kv.transfer import Layout
from .channel import PlanChannel


@dataclass
class GroupHandoff:
    """Rank 0's side: ``tell`` sends a message to the other ranks (the runner's broadcast, which says when the group
    broke); the parts come back through the plan channel's group."""

    channel: PlanChannel
    tell: Callable[[str, object], None]
    _layouts: list[Layout] | None = field(default=None, init=False)

    def layouts(self) -> list[Layout]:
        if self._layouts is None:  # asked once: a pool's layout is fixed for its life
            self.tell("kv_layout", None)
            self._layouts = self.channel.gather("a KV layout query")
        return self._layouts

    def park(self, blocks: list[int]) -> list[list[torch.Tensor]]:
        self.tell("kv_park", blocks)
        return self.channel.gather("a parking of KV parts")

    def restore(self, blocks: list[int], parts: list[list[torch.Tensor]]) -> None:
        self.tell("kv_restore", blocks)
        try:
            dist.scatter_object_list([None], [None, *parts], src=self.channel.leader, group=self.channel.group)
        except Exception as exc:  # noqa: BLE001 - a collective fails only when the group broke
            raise EngineGroupLost(f"tensor-parallel group broke handing its ranks their KV parts: {exc}") from exc


def follow(kind: str, payload: object, pool: KVCachePool, channel: PlanChannel) -> None:
    """A follower's part of a ``kv_layout``, ``kv_park`` or ``kv_restore`` message of rank 0's."""
    group, leader = channel.group, channel.leader
    if kind == "kv_layout":
        dist.gather_object(pool.block_layout(), None, dst=leader, group=group)
    elif kind == "kv_park":
        dist.gather_object(ParkedKV.park(pool, payload, 0).host, None, dst=leader, group=group)
    else:
        mine: list = [None]
        dist.scatter_object_list(mine, None, src=leader, group=group)
        ParkedKV(payload, mine[0], 0, 0, 0.0).restore(pool)
