"""The ranks left after a rank's loss form a new group in the same processes (engine.group.regroup): four processes
over gloo exchange rows with all-to-alls, one is SIGKILLed mid-exchange, the three others fail in their collective
(none waits out the collective timeout), meet in the rendezvous store, and exchange over a group of three; their PIDs
are the ones that served before. A rank that registers after the membership was sealed is told it is out."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import queue
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megatron_serve.engine.group.regroup import regroup
from megatron_serve.errors import EngineGroupLost

from ..helpers import free_port

pytestmark = pytest.mark.timeout(300)

WORLD = 4
KILLED = 2
#: the collective timeout of both groups: the survivors must regroup far sooner than it
COLLECTIVE = datetime.timedelta(seconds=120)


def exchange(size: int, value: int) -> tuple[list[float], float]:
    """One all-to-all (each rank sends ``value``, its old rank, to every other) and one all-reduce, over the default
    group."""
    received = torch.empty(size)
    dist.all_to_all_single(received, torch.full((size,), float(value)))
    total = torch.ones(1)
    dist.all_reduce(total)
    return received.tolist(), total.item()


def member(rank: int, port: int, reports: multiprocessing.Queue) -> None:
    """A rank: exchange until a collective fails, regroup, exchange over the new group, and say what it saw."""
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, wait_for_workers=False, timeout=COLLECTIVE)
    dist.init_process_group("gloo", store=dist.PrefixStore("start/", store), rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE)
    steps = 0
    try:
        while True:
            exchange(WORLD, rank)
            steps += 1
            if steps == 3:
                reports.put(("serving", rank, os.getpid()))
    except RuntimeError:  # a dead peer's connection, or a survivor's that left the broken group
        failed = time.monotonic()
    new = regroup(store, 1, rank, WORLD, wait_s=30, timeout=COLLECTIVE)
    seconds = time.monotonic() - failed
    received, total = exchange(len(new.members), rank)
    reports.put(("regrouped", rank, os.getpid(), new.members, new.rank, received, total, seconds))
    dist.barrier()
    dist.destroy_process_group()


def test_the_ranks_left_regroup_in_their_own_processes_and_exchange_again():
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    port = free_port()
    processes = [context.Process(target=member, args=(rank, port, reports), daemon=True) for rank in range(WORLD)]
    for process in processes:
        process.start()
    try:
        serving = dict(sorted(report[1:] for report in (reports.get(timeout=120) for _ in range(WORLD))))
        assert serving == {rank: p.pid for rank, p in enumerate(processes)}
        os.kill(processes[KILLED].pid, signal.SIGKILL)  # mid-exchange: the others loop on their collectives
        regrouped = {}
        while len(regrouped) < WORLD - 1:
            report = reports.get(timeout=120)
            if report[0] == "regrouped":
                regrouped[report[1]] = report[2:]
        for process in processes:
            process.join(timeout=60)
    except queue.Empty:
        pytest.fail("a rank said nothing for 120 s")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    survivors = [0, 1, 3]
    assert sorted(regrouped) == survivors
    for new_rank, rank in enumerate(survivors):
        pid, members, got_rank, received, total, seconds = regrouped[rank]
        assert pid == serving[rank]  # the same process, not a restart
        assert (members, got_rank, received, total) == (survivors, new_rank, [0.0, 1.0, 3.0], 3.0)
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s to regroup"
    assert [p.exitcode for p in processes] == [0, 0, -signal.SIGKILL, 0]


def test_a_rank_that_comes_after_the_seal_is_out():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=COLLECTIVE)
    store.compare_set("regroup/1/members", "", json.dumps([0, 1]))  # the survivors sealed generation 1 already
    with pytest.raises(EngineGroupLost, match=r"rank 2 registered after the ranks left sealed generation 1 without "
                                              r"it \(\[0, 1\]\)"):
        regroup(store, 1, 2, 3, wait_s=0.0, timeout=COLLECTIVE)
    assert not dist.is_initialized()
