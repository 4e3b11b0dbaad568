"""Sessions and data-parallel pins in the coordinator's core, without sockets (coordinator.placement)."""

from __future__ import annotations

import msgspec

from megatron_serve.coordinator.placement import Sessions
from megatron_serve.wire.messages import Status, Submit
from megatron_serve.wire.placement import Placement
from megatron_serve.wire.protocol import ErrorCode, Header

from .core_harness import CoreHarness
from .test_core import final_record, step

C = b"client"
ENGINES = (b"engine-0", b"engine-1", b"engine-2")


def submit(h: CoreHarness, crid: str, session: str | None = None, rank: int | None = None) -> None:
    params = msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 2}))
    placement = None if session is None and rank is None else Placement(session_id=session, data_parallel_rank=rank)
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3], sampling_params=params,
                                    placement=placement))


def fleet(routing: str = "round_robin", **options) -> tuple[CoreHarness, dict[bytes, str]]:
    h = CoreHarness(routing=routing, **options)
    h.client(C)
    ids = {identity: h.engine(identity, group=group) for group, identity in enumerate(ENGINES)}
    return h, ids


def where(h: CoreHarness, ids: dict[bytes, str]) -> dict[str, bytes]:
    """Request id -> the engine it was just submitted to (and the submissions taken)."""
    return {body.request["request_id"]: identity for identity in ids for body in h.take(identity, Header.ENGINE_SUBMIT)}


def finish_all(h: CoreHarness, ids: dict[bytes, str], sent: dict[str, bytes]) -> None:
    for request_id, identity in sent.items():
        step(h, identity, ids[identity], request_id, [7, 8], finished=True,
             record=final_record({"request_id": request_id}, [7, 8]))


def test_a_session_stays_on_its_engine_under_round_robin_and_moves_past_the_load_bound():
    h, ids = fleet()
    submit(h, "t0", session="s")
    (home,) = where(h, ids).values()
    for turn in range(1, 6):  # one turn at a time: round robin alone would visit every engine
        submit(h, f"t{turn}", session="s")
        sent = where(h, ids)
        assert list(sent.values()) == [home]
        finish_all(h, ids, sent)
    assert h.core.dispatcher.sessions.describe()["kept"] == 5
    # Its engine busy beyond the bound (least-loaded 0, bound 4): the next turn moves, and the session with it.
    for i in range(5):
        submit(h, f"other{i}", rank=list(ids).index(home))
    where(h, ids)
    submit(h, "t6", session="s")
    (moved,) = where(h, ids).values()
    assert moved != home and h.core.dispatcher.sessions.engine_of("s", h.now) == ids[moved]


def test_sessions_expire_after_their_ttl_and_leave_with_their_engine():
    h, ids = fleet(session_ttl=30.0, heartbeat_timeout=1e6)
    submit(h, "a", session="a")
    submit(h, "b", session="b")
    sent = where(h, ids)
    finish_all(h, ids, sent)
    h.advance(20)
    submit(h, "a2", session="a")  # used: its clock restarts
    finish_all(h, ids, where(h, ids))
    h.advance(20)
    sessions = h.core.dispatcher.sessions
    assert sessions.engine_of("b", h.now) is None and sessions.engine_of("a", h.now) is not None
    home = sent["c1/a"]
    h.core.remove_engine(h.core.members.engines[ids[home]], "killed")
    submit(h, "a3", session="a")
    (elsewhere,) = where(h, ids).values()
    assert elsewhere != home and h.core.dispatcher.sessions.engine_of("a", h.now) == ids[elsewhere]


def test_a_rank_pins_whatever_the_policy_prefers_and_an_unknown_rank_is_refused_by_name():
    h, ids = fleet(routing="least_loaded")
    for i in range(4):
        submit(h, f"p{i}", rank=2)
    assert set(where(h, ids).values()) == {ENGINES[2]}  # (group, rank) order: group 2 is rank 2
    submit(h, "far", rank=3)
    (error,) = h.take(C, Header.ERROR)
    assert error.code == ErrorCode.INVALID_PLACEMENT.value and error.client_request_id == "far"
    assert "rank 3 is out of range: 3 engine(s) serve (ranks 0 to 2)" in error.message


def test_a_pinned_request_fails_when_its_engine_goes_and_an_unpinned_one_moves():
    h, ids = fleet()
    submit(h, "free", session="s")
    (home,) = where(h, ids).values()
    submit(h, "pinned", rank=list(ids).index(home))
    assert list(where(h, ids).values()) == [home]
    h.core.remove_engine(h.core.members.engines[ids[home]], "killed")
    h.send(C, Header.STATUS, Status(status_id=1))  # any input: the core settles and dispatches
    (result,) = h.take(C, Header.RESULT)
    assert result.client_request_id == "pinned" and result.request["status"] == "FAILED"
    assert result.request["finish_reason"] == "abort" and "pinned engine is gone" in result.request["error"]
    (elsewhere,) = where(h, ids).values()
    assert elsewhere != home and h.core.dispatcher.sessions.engine_of("s", h.now) == ids[elsewhere]


def test_the_session_table_forgets_the_least_recently_used_beyond_its_size():
    sessions = Sessions(ttl_s=100.0, max_sessions=2)
    for number, session in enumerate("abc"):
        sessions.bind(session, "e", float(number))
    assert sessions.engine_of("a", 3.0) is None and sessions.engine_of("c", 3.0) == "e" and len(sessions) == 2
