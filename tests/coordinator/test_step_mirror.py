"""The mirror kept per step (issue 84): a plain share of an engine step (ids, epochs, log probs) is read only for
its request id, its ids and whether it ends the request, filed as the engine's bytes and forwarded; the request's
mirror reads the filed shares only when something reads it (a move, a catch-up, an abort), whole and in order. A
share with prompt scores, routing rows or kept ids is read whole at once."""

from __future__ import annotations

import msgspec

from megatron_serve.coordinator.requests import UNREAD_LIMIT
from megatron_serve.wire.messages import PromptScores
from megatron_serve.wire.protocol import Header

from .test_core import C, E1, E2, submit
from .test_core_output_path import delta, dispatched, send_step


def test_plain_shares_are_filed_unread_and_read_whole_when_the_mirror_is():
    h, e1 = dispatched(tokens=10)
    send_step(h, e1, delta([5], new_log_probs=[-0.5], epochs=[[3], [2], [-1]]))
    send_step(h, e1, delta([6, 7], new_log_probs=[-0.25, -0.125], epochs=[[3, 3], [2, 2], [1, 1]]))
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
