"""The attention ranks of one data-parallel group (``engine --data-parallel-size N --data-parallel-rank d --group g``,
as ``run`` and the operator start them) register as engines of one group, each holding its rank of it; a second
engine for a held rank is refused naming the rank, a bad rank is refused naming the field, and routing cycles over
every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from megatron_serve.coordinator.routing import RoundRobin
from megatron_serve.wire.messages import Hello, Status
from megatron_serve.wire.handshake import ENGINE_PROTOCOL, PROTOCOL_VERSION
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

E0, E1, E2 = b"engine-0", b"engine-1", b"engine-2"


def rank(d: int, size: int = 2) -> dict[str, int]:
    return {"data_parallel_rank": d, "data_parallel_size": size}


def engines(h: CoreHarness) -> list[tuple[str, int]]:
    return [(e["id"], e["group"]) for e in h.core.status(Status(), h.now).engines]


def test_the_ranks_of_one_group_register_side_by_side_and_a_held_rank_is_refused_by_name():
    h = CoreHarness()
    assert h.engine(E1, group=0, **rank(1)) == "e1-g0-dp1"
    assert h.engine(E0, group=0, **rank(0)) == "e2-g0-dp0"
    assert engines(h) == [("e2-g0-dp0", 0), ("e1-g0-dp1", 0)]  # by group, then rank
    h.send(E2, Header.HELLO, Hello(role="engine", engine_group=0, info=rank(1), protocol=PROTOCOL_VERSION))
    [error] = h.take(E2, Header.ERROR)
    assert error.code == "group_in_use" and "engine group 0 data-parallel rank 1 is held by live engine e1-g0-dp1" \
        in error.message
    # the control: without data-parallel ranks, one engine holds a group
    h.send(E2, Header.HELLO, Hello(role="engine", engine_group=0, protocol=PROTOCOL_VERSION))
    assert h.take(E2, Header.ERROR)[0].code == "group_in_use"


def test_a_restarted_rank_takes_its_rank_back_and_the_other_rank_stays():
    h = CoreHarness()
    h.engine(E0, group=0, **rank(0))
    kept = h.engine(E1, group=0, **rank(1))
    h.gone.add(E0)  # its process was killed: the probe finds the old connection gone
    again = h.engine(E2, group=0, **rank(0))
    assert engines(h) == [(again, 0), (kept, 0)]


def test_an_engine_without_a_group_takes_the_first_group_whose_rank_is_free():
    h = CoreHarness()
    h.engine(E0, group=0, **rank(0))
    assert h.engine(E1, **rank(1)) == "e2-g0-dp1"
    assert h.engine(E2, **rank(1)) == "e3-g1-dp1"


@pytest.mark.parametrize("info", [{"data_parallel_rank": 2, "data_parallel_size": 2},
                                  {"data_parallel_rank": "0", "data_parallel_size": 2},
                                  {"data_parallel_rank": True, "data_parallel_size": 2},
                                  {"data_parallel_size": 2}],
                         ids=["out-of-range", "text", "bool", "size-only"])
def test_a_bad_rank_is_refused_naming_the_field(info):
    h = CoreHarness()
    h.send(E0, Header.HELLO, Hello(role="engine", engine_group=0, info=info, protocol=PROTOCOL_VERSION))
    [error] = h.take(E0, Header.ERROR)
    assert error.code == "invalid_request" and "data_parallel_rank" in error.message
    assert engines(h) == []


@dataclass
class View:
    engine_id: str
    group: int
    info: dict[str, Any] = field(default_factory=dict)


def test_round_robin_cycles_over_every_rank_of_a_group():
    ranks = [View("a", 0, rank(0)), View("b", 0, rank(1)), View("c", 1, rank(0)), View("d", 1, rank(1))]
    policy = RoundRobin()
    assert [policy.select(None, ranks).engine_id for _ in range(5)] == ["a", "b", "c", "d", "a"]


@pytest.mark.parametrize("protocol", [2, ENGINE_PROTOCOL - 1])
def test_an_engine_below_the_engine_protocol_is_refused_naming_both_versions(protocol):
    """An older engine would send each finished request's record inside its last delta, where the coordinator no
    longer reads it: it is refused by name, and never registered."""
    h = CoreHarness()
    h.send(E0, Header.HELLO, Hello(role="engine", engine_group=0, protocol=protocol))
    [error] = h.take(E0, Header.ERROR)
    assert error.code == "unsupported", error
    assert f"engine speaks wire protocol {protocol}" in error.message
    assert f"needs {ENGINE_PROTOCOL} or later" in error.message
    assert engines(h) == []
    assert h.engine(E1, group=0) == "e1-g0"  # the control: an engine of this release registers
