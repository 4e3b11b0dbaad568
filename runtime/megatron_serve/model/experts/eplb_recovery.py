"""Where an MoE layer's experts go when an expert-parallel rank is lost and the group serves on with the ranks left
(issue 63's "a rank's loss without a restart"; SGLang's fault-tolerant EP).

The lost rank's slots are gone. Every logical expert must still have a replica, so :func:`survivor_plan` gives the
survivors ``max(P / ep, ceil(E / survivors))`` slots each (the slot count a rank holds may grow), keeps every slot a
survivor holds where it is (its weights need no transfer), and places the experts that no survivor holds (their only
replicas were on the lost rank) first in the new slots, then over the replicas of experts that have another copy. Any
slot still empty gets a copy of the expert with the fewest copies, on a rank not holding it where one exists. The plan
is plain integer arithmetic, the same on every survivor, so they agree on it without exchanging it, as EPLB's plans.

:func:`recovery` is one survivor's part: the new placement, the moves among the survivors (:func:`.expert_moves.
plan_moves` over the survivors' old slots: a replica a survivor holds is copied from there), and the slots this rank
fills from the checkpoint (the experts no survivor holds). EPLB's next plan then balances the new placement by the
measured load, as it balances any other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .eplb import identity_plan
from .moves import Moves, plan_moves


@dataclass(frozen=True)
class Recovery:
    """One survivor's way to the placement over the ranks left: ``placement`` (physical-to-logical, ``per_rank``
    slots per survivor, survivors in their old order), ``moves`` (among the survivors, in their new numbering) and
    ``loads``: ``(new slot, logical expert)`` pairs this rank reads from the checkpoint."""

    placement: list[int]
    per_rank: int
    moves: Moves
    loads: list[tuple[int, int]]


def survivor_plan(old: Sequence[int], ranks: int, lost: Collection[int], num_experts: int) -> list[int]:
    """The physical-to-logical map over the ranks of ``range(ranks)`` not in ``lost`` (see the module docstring)."""
    survivors = [r for r in range(ranks) if r not in lost]
    if not survivors:
        raise ValueError(f"every one of the {ranks} expert-parallel ranks is lost: no rank is left to serve")
    old_per = len(old) // ranks
    per_rank = max(old_per, -(-num_experts // len(survivors)))
    slots: list[list[int | None]] = [[*old[r * old_per:(r + 1) * old_per], *[None] * (per_rank - old_per)]
                                     for r in survivors]
    copies = Counter(e for rank in slots for e in rank if e is not None)
    for expert in (e for e in range(num_experts) if e not in copies):
        rank, slot = _free_slot(slots, copies)
        if slots[rank][slot] is not None:
            copies[slots[rank][slot]] -= 1
        slots[rank][slot] = expert
        copies[expert] = 1
    for rank in slots:
        for slot, held in enumerate(rank):
            if held is None:
                expert = min(range(num_experts), key=lambda e: (e in rank, copies[e], e))
                rank[slot] = expert
                copies[expert] += 1
    return [e for rank in slots for e in rank]  # type: ignore[misc]


def _free_slot(slots: list[list[int | None]], copies: Counter) -> tuple[int, int]:
    """Where an expert no survivor holds goes: an empty slot (on the rank with the most of them, the first among
    equals), else the slot of a replica whose expert has the most copies (the first among equals)."""
    empty = [(-sum(held is None for held in rank), r) for r, rank in enumerate(slots) if None in rank]
    if empty:
        rank = min(empty)[1]
        return rank, slots[rank].index(None)
    candidates = [(-copies[held], r, s) for r, rank in enumerate(slots) for s, held in enumerate(rank)
                  if copies[held] > 1]
    _, rank, slot = min(candidates)  # non-empty: the slots outnumber the experts, so some expert has two copies
    return rank, slot


def recovery(old: Sequence[int], ranks: int, lost: Collection[int], num_experts: int, rank: int) -> Recovery:
    """Survivor ``rank``'s (its old rank) part of going to :func:`survivor_plan`'s placement."""
    survivors = [r for r in range(ranks) if r not in lost]
    if rank not in survivors:
        raise ValueError(f"rank {rank} is among the lost ranks {sorted(lost)}")
    placement = survivor_plan(old, ranks, lost, num_experts)
    old_per, per_rank = len(old) // ranks, len(placement) // len(survivors)
    kept = [e for r in survivors for e in old[r * old_per:(r + 1) * old_per]]
    missing = set(range(num_experts)) - set(kept)
    index = survivors.index(rank)
    moves = plan_moves(kept, placement, len(survivors), index, missing)
    mine = placement[index * per_rank:(index + 1) * per_rank]
    return Recovery(placement, per_rank, moves, [(slot, e) for slot, e in enumerate(mine) if e in missing])


def members_plan(size: int, members: Collection[int], num_experts: int, num_physical: int) -> list[int]:
    """The physical-to-logical map of a group started with ``size`` ranks and ``num_physical`` physical experts (its
    first placement, :func:`.eplb.identity_plan`: experts by index, then EPLB's redundant copies) that now has
    ``members``: :func:`survivor_plan` as if every other rank were lost, so that it depends on the membership alone
    (a joiner computes it without the group's history, and a group back at full size is back at its first
    placement)."""
    return survivor_plan(identity_plan(num_experts, num_physical, size), size,
                         [r for r in range(size) if r not in members], num_experts)


def relocation(held: Sequence[int], placement: Sequence[int], ranks: int, index: int) -> Recovery:
    """Rank ``index``'s (of ``ranks``) way from the experts it ``held`` (one per slot) to its slots of
    ``placement``: the experts it holds copied from its own slots, the others read from the checkpoint (a planned
    change's: a joiner holds none, so none can be moved to it from ranks that may have left)."""
    per_rank = len(placement) // ranks
    mine = placement[index * per_rank:(index + 1) * per_rank]
    own = {expert: slot for slot, expert in reversed(list(enumerate(held)))}
    local = [(own[expert], slot) for slot, expert in enumerate(mine) if expert in own]
    loads = [(slot, expert) for slot, expert in enumerate(mine) if expert not in own]
    return Recovery(list(placement), per_rank, Moves(local, [[] for _ in range(ranks)], [[] for _ in range(ranks)]),
                    loads)
