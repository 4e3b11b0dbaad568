"""The size each expert-parallel group is wanted at, in the coordinator's STATUS (``expert_groups``): the group's
``--data-parallel-size`` from the start (not ``scaled``: ``run`` starts no rank for it), the size SCALE_EP asks for
from the moment it goes to the engines (before any rank can leave, so that ``run`` never reads an older size after a
rank left), back to the size before when the engines refuse it; ``control status`` prints it beside the ranks
connected."""

from __future__ import annotations

from megatron_serve.commands.control import format_status
from megatron_serve.wire.messages import ControlAck, ScaleEp, Status
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness
from .test_scale_ep import C, ENGINES, group_of_three


def expert_groups(h: CoreHarness) -> list[dict]:
    return h.core.status(Status(), h.now).expert_groups


def scale(h: CoreHarness, size: int, control_id: str, *others: bytes, **detail: object) -> None:
    h.send(C, Header.SCALE_EP, ScaleEp(control_id=control_id, size=size))
    assert expert_groups(h)[0]["wanted"] == size  # as soon as it goes to the engines
    for identity in (*ENGINES, *others):
        h.take(identity, Header.SCALE_EP)
        h.send(identity, Header.CONTROL_ACK, ControlAck(control_id=f"{control_id}#0", state="RUNNING", detail=detail))


def test_status_shows_each_group_s_size_wanted_beside_its_ranks_and_scale_ep_sets_it():
    h = CoreHarness(heartbeat_timeout=1000.0)
    h.client(C)
    group_of_three(h)
    h.engine(b"replica", group=1)  # no data-parallel attention: no expert group
    assert expert_groups(h) == [{"group": 0, "wanted": 3, "scaled": False, "size": 3, "ranks": [0, 1, 2]}]
    scale(h, 2, "down", b"replica", leaving=False)
    assert h.take(C, Header.CONTROL_ACK)
    assert expert_groups(h) == [{"group": 0, "wanted": 2, "scaled": True, "size": 3, "ranks": [0, 1, 2]}]
    h.core.remove_engine(h.core.members.engines[next(iter(h.core.members.engines))], "gone", expected=True)
    assert expert_groups(h) == [{"group": 0, "wanted": 2, "scaled": True, "size": 3, "ranks": [1, 2]}]
    scale(h, 3, "up", b"replica", leaving=False)
    assert h.take(C, Header.CONTROL_ACK)
    assert expert_groups(h)[0]["wanted"] == 3


def test_a_refused_scale_ep_leaves_the_size_wanted_before_it():
    h = CoreHarness(heartbeat_timeout=1000.0)
    h.client(C)
    group_of_three(h)
    scale(h, 2, "s", error="scale-ep 2: this engine is not a rank of an expert-parallel group ...")
    assert h.take(C, Header.ERROR)
    assert expert_groups(h)[0] == {"group": 0, "wanted": 3, "scaled": False, "size": 3, "ranks": [0, 1, 2]}


def test_control_status_prints_the_size_wanted_and_the_ranks_connected():
    status = {"state": "RUNNING", "queued": 0, "in_flight": 0, "completed": 0, "failed": 0, "engines": [],
              "expert_groups": [{"group": 0, "wanted": 3, "size": 3, "ranks": [0, 1]}]}
    assert ("expert-parallel group 0: 2 of 3 wanted ranks connected (0, 1; --data-parallel-size 3)"
            in format_status(status).splitlines())
