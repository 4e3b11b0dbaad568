"""The records of a running expert-parallel group's planned changes in a real rendezvous store (a TCPStore served
here, a second client as the joiner's): the leader sees an ask with one counter read, plans the next generation
(joiners in, the highest ranks out down to a wanted size), answers each joiner, and refuses what it cannot take;
every wait is bounded and names what did not come."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from megatron_serve.engine.group.membership import (CHECK_S, ChangeWatch, Membership, announce, ask_to_join,
                                                    await_admission, meet, plan_change, read_change, running,
                                                    want_size)
from megatron_serve.errors import EngineGroupLost



@pytest.fixture
def stores():
    # port 0: the kernel picks a port no other test's store holds (a port found free, then bound, can be taken in
    # between by another worker's store, which the joiner would then reach instead of this one)
    host = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    joiner = dist.TCPStore("127.0.0.1", host.port, 2, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield host, joiner


def seen(watch: ChangeWatch) -> bool:
    watch.next_look = 0.0  # the next turn after CHECK_S
    return watch.pending()


def test_a_joiner_is_taken_into_the_next_generation_and_told_so(stores):
    host, joiner = stores
    assert running(joiner) is None  # no group formed yet: a start with the others
    announce(host, Membership(1, [0, 1, 3], 4))
    assert running(joiner) == Membership(1, [0, 1, 3], 4)
    now = [100.0]
    watch = ChangeWatch(host, clock=lambda: now[0])  # the turns' clock, held still: no look is due by load alone
    assert not seen(watch)
    token = ask_to_join(joiner, 2)
    assert seen(watch)
    now[0] += CHECK_S / 2
    assert not watch.pending(), f"looked again within {CHECK_S} s"
    watch.taken()
    plan = plan_change(host, Membership(1, [0, 1, 3], 4))
    assert plan == Membership(2, [0, 1, 2, 3], 4)
    assert read_change(joiner, 2, 1) == plan
    assert await_admission(joiner, token, 1) == plan
    assert not seen(watch)


def test_the_highest_ranks_leave_down_to_the_wanted_size_and_a_joiner_cut_by_it_is_refused(stores):
    host, joiner = stores
    token = ask_to_join(joiner, 3)
    want_size(joiner, 2)
    plan = plan_change(host, Membership(4, [0, 1, 2], 4))
    assert plan == Membership(5, [0, 1], 4)
    with pytest.raises(EngineGroupLost, match="shrink to 2 ranks"):
        await_admission(joiner, token, 1)
    assert plan_change(host, Membership(5, [0, 1], 4)) == Membership(6, [0, 1], 4)  # the wanted size was applied


def test_a_rank_still_a_member_is_refused_and_a_missing_answer_ends_the_wait(stores):
    host, joiner = stores
    token = ask_to_join(joiner, 1)
    assert plan_change(host, Membership(0, [0, 1, 2], 3)).members == [0, 1, 2]
    with pytest.raises(EngineGroupLost, match="rank 1 is still a member of generation 0"):
        await_admission(joiner, token, 1)
    with pytest.raises(EngineGroupLost, match="did not take this rank in within 0 s"):
        await_admission(joiner, ask_to_join(joiner, 2), 0.2)
    with pytest.raises(EngineGroupLost, match="wrote no plan for generation 9"):
        read_change(joiner, 9, 0.2)


def test_an_ask_made_while_the_group_regrouped_reaches_the_next_leaders_watch(stores):
    host, joiner = stores
    watch = ChangeWatch(host)
    ask_to_join(joiner, 1)
    watch.taken()
    plan_change(host, Membership(0, [0, 2], 3))
    token = ask_to_join(joiner, 3)  # meanwhile a rank was lost: the survivors regroup and watch anew
    assert seen(ChangeWatch(host))
    assert plan_change(host, Membership(2, [0, 1, 2], 4)).members == [0, 1, 2, 3]
    assert await_admission(joiner, token, 1).generation == 3


def test_the_members_meet_before_forming_a_group_and_a_missing_one_is_named(stores):
    host, joiner = stores
    plan = Membership(3, [0, 2, 3], 4)
    host.set("regroup/3/ready/0", "1")  # the others said they are there: the last one finds them all at once
    host.set("regroup/3/ready/3", "1")
    meet(joiner, plan, 2, 1)
    with pytest.raises(EngineGroupLost, match=r"data-parallel rank\(s\) \[1\] did not come to form generation 4"):
        meet(host, Membership(4, [0, 1], 4), 0, 0.2)
