"""An engine group's rendezvous: no port is picked free and bound later, and a port that cannot be bound fails at once.

A data-parallel test's rank 0 once met EADDRINUSE on a port picked free moments before, and its message said it
had waited the whole rendezvous time-out. Ranks started here now meet at a port the kernel gave rank 0's store;
a port given from outside (the operator's ``MASTER_PORT``) that is taken fails in well under a second."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist

from megatron_serve.config import InferenceConfig
from megatron_serve.engine.group.placement import Placement, host_store, join_group, placement_for, reserve_rendezvous

pytestmark = pytest.mark.timeout(120)


def test_ranks_on_this_machine_meet_at_a_port_the_kernel_gave_rank_zero(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    local = placement_for(2)
    assert local.master_port == 0  # nothing picked yet: no window in which another process can take it
    listener, placement = reserve_rendezvous(local)
    assert placement.master_port > 0
    with socket.socket() as probe:  # bound and listening already, before any rank starts
        probe.connect((placement.master_addr, placement.master_port))
    store = host_store(listener, placement)
    assert store.port == placement.master_port
    store.set("probe", "served")
    assert dist.TCPStore(placement.master_addr, placement.master_port, 2, is_master=False).get("probe") == b"served"


def test_a_taken_port_fails_at_once_and_says_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(RuntimeError) as refused:
            join_group(Placement(2, 0, 2, "127.0.0.1", port), 0, torch.device("cpu"),
                       InferenceConfig(tensor_parallel_size=2))
    assert time.monotonic() - began < 30  # the rendezvous time-out is 300 s
    assert "EADDRINUSE" in str(refused.value) and f"127.0.0.1:{port}" in str(refused.value)
    assert "are all 2 ranks started" not in str(refused.value)
