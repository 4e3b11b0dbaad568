"""SCALE_EP on the coordinator's side, without sockets: a size its expert-parallel group cannot have is refused naming
it; the verb goes to every engine, the ones that leave are routed nothing more, and the requests each hands back in
its acknowledgement go to the engines that stay."""

from __future__ import annotations

import pytest

from megatron_serve.wire.messages import ControlAck, ScaleEp, Status
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness
from .test_core import submit

C = b"client"
ENGINES = [b"engine-0", b"engine-1", b"engine-2"]


def group_of_three(h: CoreHarness) -> list[str]:
    return [h.engine(identity, group=0, data_parallel_rank=rank, data_parallel_size=3)
            for rank, identity in enumerate(ENGINES)]


@pytest.mark.parametrize("size, message", [
    (4, "SCALE_EP size must be an integer in [1, 3] (the group's --data-parallel-size), got 4"),
    (0, "SCALE_EP size must be an integer in [1, 3] (the group's --data-parallel-size), got 0"),
    (None, "SCALE_EP size must be an integer in [1, 3] (the group's --data-parallel-size), got None"),
])
def test_a_size_the_group_cannot_have_is_refused_naming_it(size, message):
    h = CoreHarness()
    h.client(C)
    group_of_three(h)
    h.send(C, Header.SCALE_EP, ScaleEp(control_id="s", size=size))
    [error] = h.take(C, Header.ERROR)
    assert error.code == "invalid_request" and error.message == message
    assert not h.take(ENGINES[2], Header.SCALE_EP)


def test_scale_ep_needs_a_group_of_data_parallel_attention_ranks():
    h = CoreHarness()
    h.client(C)
    h.engine(ENGINES[0], group=0)
    h.send(C, Header.SCALE_EP, ScaleEp(control_id="s", size=1))
    [error] = h.take(C, Header.ERROR)
    assert "SCALE_EP needs an expert-parallel group of data-parallel attention ranks" in error.message


def test_the_leaving_rank_is_routed_nothing_more_and_what_it_hands_back_goes_to_the_others():
    h = CoreHarness(heartbeat_timeout=1000.0)
    h.client(C)
    ids = group_of_three(h)
    for n in range(6):
        submit(h, f"r{n}")
    held = {identity: [s.request["request_id"] for s in h.take(identity, Header.ENGINE_SUBMIT)]
            for identity in ENGINES}
    assert held[ENGINES[2]], held
    h.send(C, Header.SCALE_EP, ScaleEp(control_id="s", size=2))
    for identity in ENGINES:
        assert [b.size for b in h.take(identity, Header.SCALE_EP)] == [2]
    h.send(ENGINES[2], Header.CONTROL_ACK, ControlAck(control_id="s#0", state="RUNNING", detail={
        "leaving": True, "handed_back": held[ENGINES[2]]}))
    moved = [s.request["request_id"] for identity in ENGINES[:2] for s in h.take(identity, Header.ENGINE_SUBMIT)]
    assert sorted(moved) == sorted(held[ENGINES[2]])
    for identity in ENGINES[:2]:
        h.send(identity, Header.CONTROL_ACK, ControlAck(control_id="s#0", state="RUNNING", detail={"leaving": False}))
    [ack] = h.take(C, Header.CONTROL_ACK)
    assert ack.detail["wanted"] == 2 and ack.detail["leaving"] == [ids[2]]
    submit(h, "later")
    assert not h.take(ENGINES[2], Header.ENGINE_SUBMIT)  # draining: it leaves at the group's next turn
    engines = {e["id"]: e for e in h.core.status(Status(), h.now).engines}
    assert engines[ids[2]]["state"] == "DRAINING"


def test_an_engine_that_cannot_change_its_group_refuses_the_verb_naming_itself():
    h = CoreHarness()
    h.client(C)
    ids = group_of_three(h)
    h.send(C, Header.SCALE_EP, ScaleEp(control_id="s", size=2))
    why = "scale-ep 2: this engine is not a rank of an expert-parallel group of data-parallel attention ranks ..."
    for identity in ENGINES:
        h.send(identity, Header.CONTROL_ACK, ControlAck(control_id="s#0", state="RUNNING", detail={"error": why}))
    [error] = h.take(C, Header.ERROR)
    assert error.code == "invalid_request" and error.message == f"SCALE_EP refused by engine {ids[0]} and 2 more: {why}"
