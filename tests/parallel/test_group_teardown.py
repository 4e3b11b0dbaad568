"""An engine's shutdown frees its gloo groups' threads there and then: ``dist.destroy_process_group`` alone left every
group the model still held running (worker and transport threads) until a later collection or the interpreter's
teardown, where one process of a data-parallel test died with "terminate called without an active exception"."""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_serve.engine.group.placement import join_data_parallel, release_groups

from ..forked import forked_reports, report


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def groups() -> None:
    """In a child forked from the test's process: thread counts of that process alone (a fork has one thread), and a
    default group of its own."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # a port from the kernel: none to be taken first
    before = threads()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tp, channel = join_data_parallel(0, 1, 1, "gloo")  # the groups of data-parallel attention, as an engine's
    channel.send("stop")
    dist.destroy_process_group()
    destroyed = threads()
    release_groups(tp, channel)
    report(before, destroyed, threads())


def test_released_groups_leave_no_thread_behind_and_destroying_them_alone_does():
    failed, said = forked_reports(groups, [()])
    assert failed == 0
    [(before, destroyed, released)] = [tuple(map(int, fields)) for fields in said]
    assert destroyed > before, "the control: groups still held keep their threads after destroy_process_group"
    assert released == before
