"""The ranks left after a rank's loss form a new group in the same processes and agree where each stopped
(engine.group.regroup): four processes over gloo run turns of an agreement (an all-reduce) and a pass (an all-to-all),
as data-parallel attention ranks do; one is SIGKILLed mid-loop, the three others fail in their collective (none waits
out the collective timeout), meet in the rendezvous store, resume from one step boundary as the agreement says, and
run turns over a group of three; their PIDs are the ones that served before. A rank that registers after the
membership was sealed is told it is out. :func:`resume_from` on each way the survivors can stop apart."""

from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing
import os
import signal
import time
from queue import Empty

import pytest
import torch
import torch.distributed as dist

from megatron_serve.engine.group.regroup import Progress, Resume, regroup, resume_from
from megatron_serve.engine.group.spawn import PRELOAD
from megatron_serve.engine.served import Turn
from megatron_serve.errors import EngineGroupLost

from ..helpers import free_port

pytestmark = pytest.mark.timeout(400)

WORLD = 4
KILLED = 2
#: the collective timeout of both groups: the survivors must regroup and agree far sooner than it
COLLECTIVE = datetime.timedelta(seconds=120)


def agree(value: int) -> float:
    """A turn's agreement: one all-reduce over the default group."""
    total = torch.tensor([float(value)])
    dist.all_reduce(total)
    return total.item()


def exchange(size: int, value: int) -> list[float]:
    """A pass: one all-to-all, each rank sending ``value`` (its old rank) to every other."""
    received = torch.empty(size)
    dist.all_to_all_single(received, torch.full((size,), float(value)))
    return received.tolist()


def member(rank: int, port: int, reports: multiprocessing.Queue) -> None:
    """A rank: run turns until a collective fails, regroup, resume as agreed, run one more turn, say what it saw."""
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, wait_for_workers=False, timeout=COLLECTIVE)
    dist.init_process_group("gloo", store=dist.PrefixStore("start/", store), rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE)
    turns = works = 0
    phase = "turn"
    try:
        while True:
            phase = "turn"
            agree(1)
            turns, phase = turns + 1, "work"
            exchange(WORLD, rank)
            works += 1
            if works == 3:
                reports.put(("serving", rank, os.getpid()))
    except RuntimeError:  # a dead peer's connection, or a survivor's that left the broken group
        failed = time.monotonic()
        faulthandler.dump_traceback_later(60)  # a rank that hangs from here says where (the test's captured output)
    new = regroup(store, 1, rank, WORLD, Progress(turns, works, phase, True, False), wait_s=30, timeout=COLLECTIVE)
    seconds = time.monotonic() - failed
    size, resume = len(new.members), new.resume
    if resume.assist:  # the others' redo of a pass this rank completed
        exchange(size, rank)
    if phase == "work" or resume.adopt is not None:  # the pass failed, or the pass of the turn the others agreed
        exchange(size, rank)
        works += 1
    total, received = agree(1), exchange(size, rank)  # the next turn, together
    reports.put(("regrouped", rank, os.getpid(), new.members, new.rank, received, total, seconds,
                 works == resume.works))
    dist.barrier()
    dist.destroy_process_group()


def test_the_ranks_left_regroup_agree_and_run_turns_again_in_their_own_processes():
    # forked from multiprocessing's fork server, which imports torch and this module once: four spawned ranks spent
    # most of the test's CPU importing them each
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, __name__])  # the engine's own, in case this starts the server
    # a queue each: a rank killed between its write and the release of its queue's lock leaves that queue locked
    reports = [context.Queue() for _ in range(WORLD)]
    port = free_port()
    processes = [context.Process(target=member, args=(rank, port, reports[rank]), daemon=True)
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    regrouped = {}
    try:
        serving = dict(report[1:] for report in (queue.get(timeout=240) for queue in reports))
        assert serving == {rank: p.pid for rank, p in enumerate(processes)}
        os.kill(processes[KILLED].pid, signal.SIGKILL)  # mid-loop: the others are in their collectives
        for rank in (0, 1, 3):
            report = reports[rank].get(timeout=90)
            regrouped[rank] = report[2:]
        for process in processes:
            process.join(timeout=60)
    except Empty:
        pytest.fail(f"a rank said nothing in time: {sorted(regrouped)}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    survivors = [0, 1, 3]
    assert sorted(regrouped) == survivors
    for new_rank, rank in enumerate(survivors):
        pid, members, got_rank, received, total, seconds, at_boundary = regrouped[rank]
        assert pid == serving[rank]  # the same process, not a restart
        assert (members, got_rank, received, total, at_boundary) == (survivors, new_rank, [0.0, 1.0, 3.0], 3.0, True)
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s to regroup"
    assert [p.exitcode for p in processes] == [0, 0, -signal.SIGKILL, 0]


def test_a_rank_that_comes_after_the_seal_is_out():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=COLLECTIVE)
    store.compare_set("regroup/1/members", "", json.dumps([0, 1]))  # the survivors sealed generation 1 already
    with pytest.raises(EngineGroupLost, match=r"rank 2 registered after the ranks left sealed generation 1 without "
                                              r"it \(\[0, 1\]\)"):
        regroup(store, 1, 2, 3, Progress(5, 5, "turn"), wait_s=0.0, timeout=COLLECTIVE)
    assert not dist.is_initialized()


def test_a_member_that_never_says_where_it_stopped_ends_the_wait_in_bounded_time():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=COLLECTIVE)
    store.set("regroup/1/rank/1", "1")  # rank 1 registered, then died before it said where it stopped
    began = time.monotonic()
    with pytest.raises(EngineGroupLost, match=r"rank 0: the ranks left \[0, 1\] did not all say where they stopped"):
        regroup(store, 1, 0, 3, Progress(5, 5, "turn"), wait_s=1.0, timeout=COLLECTIVE)
    assert time.monotonic() - began < 10
    assert not dist.is_initialized()


def test_all_stopped_in_the_same_phase_each_does_it_again():
    everyone = [Progress(7, 6, "work", True), Progress(7, 6, "work", True), Progress(7, 6, "work", True)]
    assert [resume_from(p, everyone) for p in everyone] == [Resume(False, None, 7)] * 3


def test_a_rank_that_finished_the_pass_the_others_failed_in_joins_their_redo_with_an_empty_one():
    ahead, behind = Progress(7, 7, "turn", True), Progress(7, 6, "work", True)
    everyone = [behind, ahead, behind]
    assert resume_from(ahead, everyone) == Resume(True, None, 7)  # an empty pass, then the next agreement again
    assert resume_from(behind, everyone) == Resume(False, None, 7)  # its pass again


def test_a_rank_that_failed_in_an_agreement_the_others_completed_takes_their_result():
    behind = Progress(6, 6, "turn", True, False)
    stepping = Progress(7, 6, "work", True, False)
    assert resume_from(behind, [behind, stepping, stepping]) == Resume(False, Turn(True, False), 7)
    assert resume_from(stepping, [behind, stepping, stepping]) == Resume(False, None, 7)
    idle = Progress(7, 6, "turn", False, False)  # the agreed turn did not step: the others are at the next one
    assert resume_from(behind, [behind, idle]) == Resume(False, Turn(False, False), 6)
    assert resume_from(idle, [behind, idle]) == Resume(False, None, 6)
