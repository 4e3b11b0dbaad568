"""The placement over the ranks left after an expert-parallel rank's loss: every logical expert placed, the survivors'
slots kept where they can be, and each survivor's moves, copies and checkpoint reads simulated on lists end with the
experts the plan names."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_serve.model.experts.eplb import identity_plan, plan_layer
from megatron_serve.model.experts.eplb_recovery import members_plan, recovery, relocation, survivor_plan


def simulate(old: list[int], ranks: int, lost: set[int], experts: int) -> list[int]:
    """Every survivor's part applied to lists (its old slots, the others' sends, its checkpoint reads): the new
    placement as the survivors hold it."""
    survivors = [r for r in range(ranks) if r not in lost]
    old_per = len(old) // ranks
    parts = {r: recovery(old, ranks, lost, experts, r) for r in survivors}
    held = []
    for index, rank in enumerate(survivors):
        part = parts[rank]
        mine = old[rank * old_per:(rank + 1) * old_per]
        result: list[int | None] = [None] * part.per_rank
        for old_slot, new_slot in part.moves.local:
            result[new_slot] = mine[old_slot]
        for source_index, source in enumerate(survivors):
            sent = [old[source * old_per + slot] for slot in parts[source].moves.sends[index]]
            assert len(sent) == len(part.moves.receives[source_index])
            for slot, expert in zip(part.moves.receives[source_index], sent):
                result[slot] = expert
        for slot, expert in part.loads:
            assert result[slot] is None, "a slot both received and read from the checkpoint"
            result[slot] = expert
        held += result
    return held


@pytest.mark.parametrize("experts, redundant, ranks, lost", [
    (16, 4, 4, {2}),  # EPLB's copies: most of the lost rank's experts have a replica elsewhere
    (16, 0, 4, {1}),  # no copies: the lost rank's four experts come from the checkpoint
    (16, 4, 4, {0, 3}),  # two of four lost
    (8, 4, 4, {3}),
])
def test_every_expert_is_placed_and_every_survivor_fills_its_slots(experts, redundant, ranks, lost):
    old = identity_plan(experts, experts + redundant, ranks)
    new = survivor_plan(old, ranks, lost, experts)
    survivors = [r for r in range(ranks) if r not in lost]
    per_rank = len(new) // len(survivors)
    assert len(new) == per_rank * len(survivors) and per_rank >= -(-experts // len(survivors))
    assert set(new) == set(range(experts))
    old_per = len(old) // ranks
    kept = sum(a == b for index, r in enumerate(survivors)
               for a, b in zip(old[r * old_per:(r + 1) * old_per], new[index * per_rank:index * per_rank + old_per]))
    only_lost = set(range(experts)) - {e for r in survivors for e in old[r * old_per:(r + 1) * old_per]}
    grown = (per_rank - old_per) * len(survivors)
    assert kept >= len(survivors) * old_per - max(0, len(only_lost) - grown)  # a kept slot changes only for them
    assert simulate(old, ranks, lost, experts) == new
    read = [e for r in survivors for _, e in recovery(old, ranks, lost, experts, r).loads]
    assert sorted(Counter(read)) == sorted(only_lost)  # what no survivor holds, and only that, is read


def test_a_balanced_placement_loses_a_rank_and_stays_complete():
    old = plan_layer([9.0, 9.0, *[1.0] * 14], 20, 4)  # the busy experts' copies spread over the ranks
    assert simulate(old, 4, {1}, 16) == survivor_plan(old, 4, {1}, 16)


def test_refusals_name_the_ranks():
    with pytest.raises(ValueError, match="every one of the 2 expert-parallel ranks is lost"):
        survivor_plan(list(range(8)), 2, {0, 1}, 8)
    with pytest.raises(ValueError, match=r"rank 1 is among the lost ranks \[1\]"):
        recovery(list(range(8)), 2, {1}, 8, 1)


@pytest.mark.parametrize("size, members, experts, physical", [
    (4, [0, 1, 3], 8, 8), (4, [0, 1, 2, 3], 8, 8), (4, [0, 3], 8, 8), (3, [0, 2], 6, 6), (8, [1, 2, 5, 6, 7], 16, 16),
    (4, [0, 1, 3], 16, 20), (4, [0, 1, 2, 3], 16, 20)])  # EPLB's redundant copies: 4 more
def test_a_planned_change_places_every_expert_over_the_members_from_what_each_holds_and_the_checkpoint(
        size, members, experts, physical):
    placement = members_plan(size, members, experts, physical)
    assert set(placement) == set(range(experts))
    per_rank = len(placement) // len(members)
    if len(members) == size:
        assert placement == identity_plan(experts, physical, size)  # back to the first placement at full size
    for index in range(len(members)):
        held = list(range(index, index + 3))  # whatever a rank holds now
        part = relocation(held, placement, len(members), index)
        result: list[int | None] = [None] * per_rank
        for old_slot, new_slot in part.moves.local:
            result[new_slot] = held[old_slot]
        for slot, expert in part.loads:
            assert result[slot] is None and expert not in held
            result[slot] = expert
        assert result == placement[index * per_rank:(index + 1) * per_rank]
        assert not any(part.moves.sends) and not any(part.moves.receives)


def test_a_joiner_computes_the_placement_the_members_use_from_the_membership_alone():
    assert members_plan(4, [0, 1, 3], 8, 8) == survivor_plan(list(range(8)), 4, [2], 8)
    assert members_plan(4, [0, 1, 3], 16, 20) == survivor_plan(identity_plan(16, 20, 4), 4, [2], 16)


def test_a_move_swapped_in_on_some_survivors_only_recovers_from_what_each_holds():
    """A loss in an EPLB move's last collective: ranks 0 and 1 swapped the new placement in, rank 3 kept the old one
    (``engine.experts.recovery`` gathers what each holds; the lost rank's slots are -1). Every expert is placed and
    each survivor's moves and reads fill its slots."""
    before = identity_plan(16, 20, 4)
    after = plan_layer([9.0, 9.0, *[1.0] * 14], 20, 4)
    held = [*after[:10], *[-1] * 5, *before[15:]]
    new = survivor_plan(held, 4, {2}, 16)
    assert set(new) == set(range(16)) and -1 not in new
    assert simulate(held, 4, {2}, 16) == new
