"""The ranks left after a rank's loss form a new group in the same processes (:func:`regroup`) and agree where each
stopped (:func:`resume_from`), instead of the whole group exiting and restarting (issue 63's "a rank's loss without
a restart"; SGLang's fault-tolerant EP rebuilds its groups over the survivors the same way).

A collective with a dead peer fails on the ranks that talk to it (gloo: the peer's connection is reset; no timeout is
waited out). Each survivor then leaves its broken default group, which closes its sockets once nothing references the
group any more (the caller drops its references; the failed collective's frames, in reference cycles, are collected
here), so a survivor still blocked in a collective with it fails too. The survivors meet in the group's rendezvous
store under ``regroup/<generation>/``: each registers its old rank; once all but one have (one loss) or ``wait_s``
passed (more), the first to look seals the membership with one compare-and-set, so every survivor reads the same list,
and a rank that registers after the seal is told it is out.

The survivors did not all stop at the same collective: a collective that completed on one rank had every rank in it,
so they stopped at most one collective apart, but that one may be the last of a step's forward on one rank and the
next turn's agreement on another. Each member writes where it stopped (:class:`Progress`) under the generation, waits
(at most ``wait_s``) for every member's, and :func:`resume_from` says how it rejoins the others at one step boundary
(every member computes it from the same records). Only then do the members form a new gloo default group, ranks in
their old order, over a prefix of the same store (``regroup/<generation>/group/``). Every wait here is bounded by
``wait_s``, far under the collective timeout; a member that cannot agree raises
:class:`~megatron_serve.errors.EngineGroupLost` and its engine exits, as on any loss.

The store lives in the process that hosts the rendezvous: data-parallel rank 0's engine by default, whose loss is a loss
of the store (the group exits as before), or a process of its own (``megatron-serve rendezvous-store``, as ``run``
starts for an elastic group), which no engine's loss takes: then rank 0 is lost like any other, and the lowest member
left leads (a generation's leader is its rank 0).
"""

from __future__ import annotations

import datetime
import gc
import json
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from ...errors import EngineGroupLost
from ..served import Turn

#: How often a survivor polls the store while it waits for the others to register.
POLL_S = 0.01


@dataclass(frozen=True)
class Progress:
    """Where a data-parallel rank stopped: ``turns`` agreements of its step loop and ``works`` MoE passes (a step's
    forward or an empty pass, one per turn that stepped) completed, the phase whose collective failed (``"turn"``:
    the next agreement; ``"work"``: the next pass), and what its last completed agreement said (``step``, ``verb``,
    ``change``)."""

    turns: int
    works: int
    phase: str
    step: bool = False
    verb: bool = False
    change: bool = False


@dataclass(frozen=True)
class Resume:
    """How one survivor rejoins the others: ``assist`` (it finished the pass the others failed in: it joins their
    redo with an empty pass first), then ``adopt`` (the turn the others agreed while this rank failed in that
    agreement: taken instead of agreeing again) or, where None, the failed phase done again. ``works``: the passes
    every rank has completed once each did so (the common step boundary, from which they go on together)."""

    assist: bool
    adopt: Turn | None
    works: int


def resume_from(mine: Progress, everyone: list[Progress]) -> Resume:
    """``mine``'s way back to the common step boundary of ``everyone`` (the members' records, ``mine`` among them).

    The ranks stopped at most one collective apart, so a rank that completed more passes than another completed the
    very pass the other failed in (it moved on to the next turn's agreement): it joins the others' redo of that pass
    with an empty one. A rank that failed in an agreement that another completed takes that rank's result (its pass
    follows, if the turn stepped, beside the others' redo of theirs). Everyone else does again what failed."""
    works = max(p.works for p in everyone)
    assist = mine.works == works and any(p.works < works for p in everyone)
    turns = max(p.turns for p in everyone)
    adopt = None
    if mine.phase == "turn" and mine.turns < turns:
        ahead = next(p for p in everyone if p.turns == turns)
        adopt = Turn(ahead.step, ahead.verb, ahead.change)
    return Resume(assist, adopt, max(p.works + (p.phase == "work") for p in everyone))


@dataclass(frozen=True)
class Regrouped:
    """The new group: ``members`` (old ranks, in their order: a member's new rank is its index), this process's new
    ``rank``, and how it rejoins the others (:func:`resume_from`)."""

    generation: int
    members: list[int]
    rank: int
    resume: Resume


def regroup(store: dist.Store, generation: int, rank: int, world_size: int, progress: Progress, wait_s: float,
            timeout: datetime.timedelta) -> Regrouped:
    """Leave the broken default group and form generation ``generation``'s group with the other survivors of the
    ``world_size`` ranks (``rank``: this process's rank in the broken group, stopped at ``progress``); ``timeout``:
    the new group's collective timeout. Raises :class:`~megatron_serve.errors.EngineGroupLost` when this rank came
    after the membership was sealed, no other rank is left to form a group with, or a member's record did not come
    within ``wait_s``."""
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
    store.set(f"{prefix}progress/{rank}", json.dumps(asdict(progress)))
    keys = [f"{prefix}progress/{member}" for member in members]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout: a member died after the seal
        raise EngineGroupLost(f"expert-parallel rank {rank}: the ranks left {members} did not all say where they "
                              f"stopped within {wait_s:.0f} s: {exc}") from exc
    everyone = [Progress(**json.loads(store.get(key))) for key in keys]
    new_rank = members.index(rank)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}group/", store), rank=new_rank,
                            world_size=len(members), timeout=timeout)
    return Regrouped(generation, members, new_rank, resume_from(progress, everyone))
