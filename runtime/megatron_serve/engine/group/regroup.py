"""The ranks left after a rank's loss form a new group in the same processes (:func:`regroup`), instead of the whole
group exiting and restarting (issue 63's "a rank's loss without a restart"; SGLang's fault-tolerant EP rebuilds its
groups over the survivors the same way).

A collective with a dead peer fails on the ranks that talk to it (gloo: the peer's connection is reset; no timeout is
waited out). Each survivor then leaves its broken default group, which closes its sockets once nothing references the
group any more (the caller drops its references; the failed collective's frames, in reference cycles, are collected
here), so a survivor still blocked in a collective with it fails too, and none waits out the collective timeout. The survivors meet in the
group's rendezvous store under ``regroup/<generation>/``: each registers its old rank; once all but one have (one
loss) or ``wait_s`` passed (more), the first to look seals the membership with one compare-and-set, so every survivor
reads the same list, and a rank that registers after the seal is told it is out. The members then form a new gloo
default group, ranks in their old order, over a prefix of the same store (``regroup/<generation>/group/``), without
the lost rank's connections.

The store lives in the process that hosted the rendezvous (rank 0's engine): the loss of that process is a loss of
the store, and the group exits as before.
"""

from __future__ import annotations

import datetime
import gc
import json
import time
from dataclasses import dataclass

import torch.distributed as dist

from ...errors import EngineGroupLost

#: How often a survivor polls the store while it waits for the others to register.
POLL_S = 0.01


@dataclass(frozen=True)
class Regrouped:
    """The new group: ``members`` (old ranks, in their order: a member's new rank is its index) and this process's
    new ``rank``."""

    generation: int
    members: list[int]
    rank: int


def regroup(store: dist.Store, generation: int, rank: int, world_size: int, wait_s: float,
            timeout: datetime.timedelta) -> Regrouped:
    """Leave the broken default group and form generation ``generation``'s group with the other survivors of the
    ``world_size`` ranks (``rank``: this process's rank in the broken group); ``timeout``: the new group's collective
    timeout. Raises :class:`~megatron_serve.errors.EngineGroupLost` when this rank came after the membership was
    sealed, or no other rank is left to form a group with."""
    gc.collect()  # a failed collective's frames hold its group in reference cycles: a group kept keeps its sockets
    if dist.is_initialized():
        dist.destroy_process_group()  # closes its connections: a survivor blocked on this rank fails at once
    gc.collect()
    prefix = f"regroup/{generation}/"
    store.set(f"{prefix}rank/{rank}", "1")
    count = store.add(f"{prefix}count", 1)
    deadline = time.monotonic() + wait_s
    while count < world_size - 1 and time.monotonic() < deadline:
        time.sleep(POLL_S)
        count = store.add(f"{prefix}count", 0)
    registered = [r for r in range(world_size) if store.check([f"{prefix}rank/{r}"])]
    members = json.loads(store.compare_set(f"{prefix}members", "", json.dumps(registered)))
    if rank not in members:
        raise EngineGroupLost(f"expert-parallel rank {rank} registered after the ranks left sealed generation "
                              f"{generation} without it ({members})")
    if len(members) < 2:
        raise EngineGroupLost(f"expert-parallel rank {rank} is the only rank left of {world_size}")
    new_rank = members.index(rank)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}group/", store), rank=new_rank,
                            world_size=len(members), timeout=timeout)
    return Regrouped(generation, members, new_rank)
