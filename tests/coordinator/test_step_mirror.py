"""The mirror kept per step (issue 84): a plain share of an engine step (ids, epochs, log probs) is read only for
its request id, its ids and whether it ends the request, filed as the engine's bytes and forwarded; the request's
mirror reads the filed shares only when something reads it (a move, a catch-up, an abort), whole and in order. A
share with prompt scores, routing rows or kept ids is read whole at once."""

from __future__ import annotations

import msgspec
import pytest

from megatron_serve.coordinator.requests import UNREAD_LIMIT
from megatron_serve.wire.messages import ClientAbort, EngineStep, PromptScores, TokenDelta
from megatron_serve.wire.protocol import Header

from .test_core import C, E1, E2, submit
from .test_core_output_path import delta, dispatched, send_step


@pytest.mark.parametrize("named", [True, False], ids=["named-plain", "protocol-8-engine"])
def test_plain_shares_are_filed_unread_and_read_whole_when_the_mirror_is(named):
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5], new_log_probs=[-0.5], epochs=[[3], [2], [-1]]), plain=named)
    send_step(h, e1, delta([6, 7], new_log_probs=[-0.25, -0.125], epochs=[[3, 3], [2, 2], [1, 1]]), plain=named)
    assert [d.new_tokens for d in h.take(C)] == [[5], [6, 7]]  # forwarded at once
    record = h.core.flow.table.get("c1/r")
    assert len(record.unread) == 2 and record.mirror.tokens == []  # filed, not read
    assert record.generated_tokens == [5, 6, 7]  # read when asked, in order
    assert record.out.log_probs == [-0.5, -0.25, -0.125]
    assert (record.out.policy_epochs, record.out.kv_epochs, record.out.lora_epochs) == ([3, 3, 3], [2, 2, 2],
                                                                                        [-1, 1, 1])
    assert record.unread == []


def test_a_share_read_whole_comes_after_the_filed_ones():
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5], epochs=[[0], [0], [-1]]))
    send_step(h, e1, delta([6], cached_tokens=2, prompt_scores=PromptScores(log_probs=[-1.0, -2.0])))
    record = h.core.flow.table.get("c1/r")
    assert record.unread == []  # the second share was mirrored at once, the first read before it
    assert record.mirror.tokens == [5, 6] and record.mirror.prompt_scores.log_probs == [-1.0, -2.0]
    assert record.cached_tokens == 2


def test_a_request_that_loses_its_engine_continues_from_its_filed_tokens():
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5], epochs=[[0], [0], [-1]]))
    send_step(h, e1, delta([6], epochs=[[0], [0], [-1]]))
    h.core.remove_engine(h.core.members.engines[e1], "lost")
    h.engine(E2, group=1)
    (moved,) = h.take(E2, Header.ENGINE_SUBMIT)
    assert moved.request["generated_tokens"] == [5, 6]


def test_an_unreadable_filed_share_is_left_out_of_the_mirror_alone():
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5], epochs=[[0], [0], [-1]]))
    send_step(h, e1, delta([6], epochs=[[0], [0], [-1]]))
    record = h.core.flow.table.get("c1/r")
    bad = msgspec.msgpack.encode({"request_id": "c1/r", "new_tokens": [7], "new_log_probs": "not a list"})
    record.file(msgspec.Raw(bad))  # as on_step files a share whose ids read but whose log probs do not
    send_step(h, e1, delta([8], epochs=[[0], [0], [-1]]))
    assert record.generated_tokens == [5, 6, 8]


def test_a_second_request_of_a_step_is_filed_beside_the_first():
    h, e1 = dispatched(tokens=10)
    submit(h, "s", tokens=10)
    assert h.take(E1, Header.ENGINE_SUBMIT)
    send_step(h, e1, delta([5]), msgspec.structs.replace(delta([9]), request_id="c1/s"))
    table = h.core.flow.table
    assert table.get("c1/r").generated_tokens == [5] and table.get("c1/s").generated_tokens == [9]


def test_a_long_request_holds_at_most_the_limit_of_filed_shares():
    h, e1 = dispatched(tokens=UNREAD_LIMIT * 3)
    for token in range(UNREAD_LIMIT + 10):
        send_step(h, e1, delta([token], epochs=[[0], [0], [-1]]))
    record = h.core.flow.table.get("c1/r")
    assert len(record.unread) == 10 and len(record.mirror.tokens) == UNREAD_LIMIT  # read in at the limit, in order
    assert record.generated_tokens == list(range(UNREAD_LIMIT + 10))


def test_a_step_names_its_plain_shares_and_none_of_them_is_read():
    """ENGINE_STEP's ``plain_ids`` (protocol 9): the named shares are filed and forwarded by those ids, unread. The
    share here carries no request id of its own, which a share read one by one must (the control: unnamed, it is
    dropped as unreadable)."""
    for named, forwarded in ((True, [[5]]), (False, [])):
        h, e1 = dispatched(tokens=10)
        share = msgspec.Raw(msgspec.msgpack.encode(TokenDelta(new_tokens=[5], epochs=[[0], [0], [-1]])))
        h.send(E1, Header.ENGINE_STEP, EngineStep(engine_id=e1, outputs=[share], plain_ids=["c1/r"] if named else []))
        assert [d.new_tokens for d in h.take(C)] == forwarded
        assert h.core.flow.table.get("c1/r").generated_tokens == [t for d in forwarded for t in d]


def test_a_step_naming_more_plain_shares_than_it_carries_is_dropped_by_name():
    h, e1 = dispatched(tokens=10)
    share = msgspec.Raw(msgspec.msgpack.encode(delta([5])))
    h.send(E1, Header.ENGINE_STEP, EngineStep(engine_id=e1, outputs=[share], plain_ids=["c1/r", "c1/s"]))
    assert h.take(C) == [] and h.core.flow.table.get("c1/r").generated_tokens == []
    assert h.core.drop.total == 1


def test_a_named_share_of_an_aborted_request_is_not_delivered():
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5]))
    assert h.take(C)
    h.send(C, Header.ABORT, ClientAbort(client_request_id="r"))  # ended here: its engine's later shares are stale
    assert h.take(C, Header.RESULT)
    stale = h.core.flow.stale_outputs
    h.send(E1, Header.ENGINE_STEP, EngineStep(engine_id=e1, outputs=[msgspec.Raw(msgspec.msgpack.encode(
        delta([6])))], plain_ids=["c1/r"]))
    assert h.take(C, Header.STEP_TOKENS) == [] and h.core.flow.table.get("c1/r").generated_tokens == [5]
    assert h.core.flow.stale_outputs == stale + 1
