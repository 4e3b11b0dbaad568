"""Who is in a running expert-parallel group of data-parallel attention ranks, and the planned changes to it (a rank
that joins, ranks that leave), as records in the group's rendezvous store (issue 63's "resizing an EP group").

A loss is found by a failed collective (:mod:`.regroup`); a planned change is asked for in the store and taken at a step
boundary the members agree on. The leader (the group's rank 0: its lowest member, in each generation) publishes the
membership of each generation (:data:`MEMBERS`: its number, the members' data-parallel ranks, the group's full size), so
that an engine started for the group after it formed, the lost rank's restart, knows it must join rather than meet the
others at the start (:func:`running`). Whoever asks for a change (a joiner, :func:`ask_to_join`; the ``scale-ep`` verb,
:func:`want_size`) bumps one counter (:data:`CHANGES`), the one key the leader reads per turn (:class:`ChangeWatch`, at
most every :data:`CHECK_S`); when it moved, the leader's turn agreement says so and every member calls the change at the
same turn. The leader then decides the next membership (:func:`plan_change`: the joiners in, the highest ranks out down
to a wanted size) and writes it under the next generation, with each admitted joiner's answer; every member reads it
(:func:`read_change`), and the members and the joiners form the next generation's group once each said it is there
(:func:`meet`). Every wait is bounded; what does not come in time is an :class:`~megatron_serve.errors.EngineGroupLost`
that names it. A rank lost during a planned change is one of those: the group ends, as on a loss before data-parallel
ranks served on.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch.distributed as dist

from ...errors import EngineGroupLost

#: The current generation's membership (json :class:`Membership`), written by the leader.
MEMBERS = "ep/members"
#: Bumped by every ask for a change: the one key the leader reads per turn.
CHANGES = "ep/changes"
#: The count of :data:`CHANGES` the last plan took in (a leader's watch starts from it, so that an ask made while
#: the group regrouped after a loss is not lost).
TAKEN = "ep/taken"
#: The size the ``scale-ep`` verb asked for, until the leader applied it.
WANTED = "ep/wanted"
#: The longest between two reads of :data:`CHANGES` by the leader: a change waits at most this long to be seen.
CHECK_S = 0.1


@dataclass(frozen=True)
class Membership:
    """Generation ``generation``'s members (data-parallel ranks, ascending: a member's rank in the group is its
    index) of a group started with ``size`` ranks."""

    generation: int
    members: list[int]
    size: int


def announce(store: dist.Store, membership: Membership) -> None:
    """The leader's record of the generation that formed (read by :func:`running`), in the store when this returns."""
    _set_seen(store, MEMBERS, json.dumps(asdict(membership)))


def _set_seen(store: dist.Store, key: str, value: str) -> None:
    """``store.set`` that returns once the store holds the value: a ``TCPStore`` answers no ``set``, so another
    client's read right after could come first (4 of 5,000 did here); a ``check`` on the same connection is answered
    only after it."""
    store.set(key, value)
    store.check([key])


def running(store: dist.Store) -> Membership | None:
    """The membership of the group that meets in ``store``, or None where none formed yet (a start with the
    others)."""
    if not store.check([MEMBERS]):
        return None
    return Membership(**json.loads(store.get(MEMBERS)))


def ask_to_join(store: dist.Store, rank: int) -> str:
    """Data-parallel rank ``rank``'s ask to join; returns the token its answer is filed under (a rank restarted
    twice must not read its first start's answer)."""
    token = f"{rank}-{os.getpid()}-{time.time_ns()}"
    store.set(f"ep/ask/{rank}", token)
    store.add(CHANGES, 1)
    return token


def want_size(store: dist.Store, size: int) -> None:
    """The ``scale-ep`` verb's ask: shrink to ``size`` ranks at the next step boundary (growing is the joiners')."""
    store.set(WANTED, str(size))
    store.add(CHANGES, 1)


def await_admission(store: dist.Store, token: str, wait_s: float) -> Membership:
    """The membership a joiner's ask (``token``) was taken into; :class:`EngineGroupLost` when it was refused or no
    answer came within ``wait_s``."""
    answer = _awaited(store, f"ep/answer/{token}", wait_s, f"asked to join the expert-parallel group ({token}); its "
                      "leader did not take this rank in")
    if "refused" in answer:
        raise EngineGroupLost(f"the expert-parallel group refused this rank's join: {answer['refused']}")
    return Membership(**answer)


class ChangeWatch:
    """The leader's per-turn look for a change asked for: one read of :data:`CHANGES`, at most every
    :data:`CHECK_S` (a turn of idle ranks comes every few milliseconds)."""

    def __init__(self, store: dist.Store, clock: Callable[[], float] = time.monotonic):
        self.store, self.clock = store, clock
        self.seen = int(store.get(TAKEN)) if store.check([TAKEN]) else 0
        self.next_look = 0.0

    def pending(self) -> bool:
        now = self.clock()
        if now < self.next_look:
            return False
        self.next_look = now + CHECK_S
        return int(self.store.add(CHANGES, 0)) != self.seen

    def taken(self) -> None:
        """The changes asked for so far are in the plan being made."""
        self.seen = int(self.store.add(CHANGES, 0))
        _set_seen(self.store, TAKEN, str(self.seen))


def plan_change(store: dist.Store, current: Membership) -> Membership:
    """The leader's plan for the next generation: ``current``'s members, the ranks that asked to join (each told its
    answer), less the highest ranks beyond a wanted size; written where :func:`read_change` finds it."""
    generation = current.generation + 1
    members = list(current.members)
    admitted: list[tuple[int, str]] = []
    for rank in range(current.size):
        key = f"ep/ask/{rank}"
        if not store.check([key]):
            continue
        token = store.get(key).decode()
        store.delete_key(key)
        if rank in members:  # its old process is not yet found lost: it asks again once the others regrouped
            store.set(f"ep/answer/{token}", json.dumps({"refused": f"data-parallel rank {rank} is still a member of "
                                                                    f"generation {current.generation}"}))
            continue
        members.append(rank)
        admitted.append((rank, token))
    if store.check([WANTED]):
        wanted = int(store.get(WANTED))
        store.delete_key(WANTED)
        members = sorted(members)[:max(wanted, 1)]
    plan = Membership(generation, sorted(members), current.size)
    store.set(f"regroup/{generation}/change", json.dumps(asdict(plan)))
    for rank, token in admitted:
        answer = asdict(plan) if rank in plan.members else {"refused": f"the group is to shrink to "
                                                                          f"{len(plan.members)} ranks"}
        store.set(f"ep/answer/{token}", json.dumps(answer))
    return plan


def meet(store: dist.Store, plan: Membership, rank: int, wait_s: float) -> None:
    """Data-parallel rank ``rank`` is about to form ``plan``'s group: once every member said so (at most ``wait_s``),
    so that no member waits out the group's rendezvous timeout for a joiner that died after its answer."""
    prefix = f"regroup/{plan.generation}/ready/"
    store.set(f"{prefix}{rank}", "1")
    try:
        store.wait([f"{prefix}{member}" for member in plan.members], datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout
        missing = [m for m in plan.members if not store.check([f"{prefix}{m}"])]
        raise EngineGroupLost(f"data-parallel rank(s) {missing} did not come to form generation {plan.generation} "
                              f"within {wait_s:.0f} s: {exc}") from exc


def read_change(store: dist.Store, generation: int, wait_s: float) -> Membership:
    """Generation ``generation``'s membership as the leader planned it (every member reads it at the agreed turn)."""
    return Membership(**_awaited(store, f"regroup/{generation}/change", wait_s, f"the expert-parallel leader agreed a "
                                 f"change but wrote no plan for generation {generation}"))


def _awaited(store: dist.Store, key: str, wait_s: float, missing: str) -> dict:
    """The json record at ``key`` once it is there; :class:`EngineGroupLost` saying ``missing`` past ``wait_s``."""
    try:
        store.wait([key], datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout
        raise EngineGroupLost(f"{missing} within {wait_s:.0f} s: {exc}") from exc
    return json.loads(store.get(key))
