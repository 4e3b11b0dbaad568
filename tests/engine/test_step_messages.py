"""An engine step's deltas go in ENGINE_STEP messages that fit the frame, however many prompt scores they carry, each
finished request's final record beside its delta in the same message.

A request's prompt scores all go with its first token: before, several requests with long scored prompts that
finished their prefill in one step made one message over the 16 MiB frame, which the engine's link then did not
send at all (every delta of the step lost, its requests left to the stall timeout).
"""

from __future__ import annotations

import msgspec
import pytest

from megatron_serve.engine.output import plain_first, step_bodies, step_messages
from megatron_serve.engine.steps import StepOutput
from megatron_serve.wire.frame_cuts import FRAME_ENTRIES
from megatron_serve.wire.request import FinalRecord, RequestStatus
from megatron_serve.wire.messages import FROM_COORDINATOR, TO_COORDINATOR, EngineStepOut, PromptScores, RequestDelta
from megatron_serve.wire.protocol import MAX_MESSAGE_BYTES, Header, ProtocolError, decode, encode


def scored(request_id: str, positions: int, k: int = 20) -> RequestDelta:
    scores = PromptScores(log_probs=[-1.25] * positions, top_ids=[list(range(1000, 1000 + k))] * positions,
                          top_log_probs=[[-2.5 - j / 7 for j in range(k)]] * positions)
    return RequestDelta(request_id=request_id, new_tokens=[7], finished=False, prompt_scores=scores)


def test_a_step_of_long_scored_prompts_is_cut_into_messages_that_fit_the_frame():
    deltas = [scored(f"r{i}", 30_000) for i in range(4)] + [RequestDelta(request_id="plain", new_tokens=[3],
                                                                           finished=False)]
    with pytest.raises(ProtocolError, match="exceeds"):  # the control: the step as one message
        encode(Header.ENGINE_STEP, EngineStepOut(engine_id="e", outputs=deltas))
    messages = step_messages(deltas)
    assert len(messages) > 1 and [d for m in messages for d in m] == deltas  # all of them, in order
    for message in messages:
        frame = encode(Header.ENGINE_STEP, EngineStepOut(engine_id="e", outputs=message))
        assert len(frame) < MAX_MESSAGE_BYTES
        assert len(decode(frame, TO_COORDINATOR).body.outputs) == len(message)


def test_a_step_of_large_kept_sets_is_cut_into_messages_that_fit_the_frame():
    """return_top_p_token_ids: a request can keep most of a 150k vocabulary at each token; 40 such requests in one
    step pass the frame, so they are cut as prompt scores are."""
    kept = [list(range(100_000, 250_000))]
    deltas = [RequestDelta(request_id=f"r{i}", new_tokens=[7], finished=False, top_p_token_ids=kept)
              for i in range(40)]
    with pytest.raises(ProtocolError, match="exceeds"):  # the control: the step as one message
        encode(Header.ENGINE_STEP, EngineStepOut(engine_id="e", outputs=deltas))
    messages = step_messages(deltas)
    assert len(messages) > 1 and [d for m in messages for d in m] == deltas
    for message in messages:
        assert len(encode(Header.ENGINE_STEP, EngineStepOut(engine_id="e", outputs=message))) < MAX_MESSAGE_BYTES


def test_a_step_without_prompt_scores_is_one_message_and_a_lone_large_delta_is_not_split():
    plain = [RequestDelta(request_id=f"r{i}", new_tokens=[i], finished=False) for i in range(64)]
    assert step_messages(plain) == [plain]
    large = scored("big", FRAME_ENTRIES)  # past the limit alone: a message of its own
    assert step_messages([large, plain[0]]) == [[large], [plain[0]]]
    assert step_messages([plain[0], large]) == [[plain[0]], [large]]


def test_a_finished_request_s_record_travels_beside_its_delta_in_its_message():
    """The coordinator forwards a delta's bytes to the client and a record's in RESULT: the record is never inside the
    delta, and it goes in the message that holds its delta."""
    scores = scored("x", 30_000).prompt_scores
    outputs = [StepOutput(f"r{i}", [7], [], i % 2 == 1, cached_tokens=0, prompt_scores=scores,
                          final=FinalRecord(request_id=f"r{i}", status=RequestStatus.COMPLETED) if i % 2 else None)
               for i in range(4)]
    bodies = step_bodies("e", outputs)
    assert len(bodies) > 1 and [d.request_id for b in bodies for d in b.outputs] == ["r0", "r1", "r2", "r3"]
    for body in bodies:
        wire = decode(encode(Header.ENGINE_STEP, body), TO_COORDINATOR).body
        finished = [d["request_id"] for d in map(msgspec.msgpack.decode, wire.outputs) if d["finished"]]
        assert all("request" not in msgspec.msgpack.decode(raw) for raw in wire.outputs)
        assert {rid: msgspec.msgpack.decode(raw)["request_id"] for rid, raw in wire.records.items()} == {
            rid: rid for rid in finished}


def test_a_step_body_puts_its_plain_deltas_first_and_names_them():
    """``plain_ids`` (protocol 9): the coordinator passes the named deltas on unread, so only a delta with new tokens,
    not finished, and without routing rows, prompt scores or kept ids is named; the others follow, read one by one."""
    finished = RequestDelta(request_id="done", new_tokens=[4], finished=True)
    scored_one = scored("scored", 3)
    empty = RequestDelta(request_id="empty", new_tokens=[], finished=False)
    kept = RequestDelta(request_id="kept", new_tokens=[5], finished=False, top_p_token_ids=[[5, 6]])
    plain = [RequestDelta(request_id=f"p{i}", new_tokens=[i], finished=False) for i in range(3)]
    body = plain_first("e", [finished, plain[0], scored_one, plain[1], empty, kept, plain[2]], {"done": None})
    assert body.plain_ids == ["p0", "p1", "p2"]
    assert body.outputs == plain + [finished, scored_one, empty, kept]
    assert plain_first("e", plain, {}).outputs == plain  # all plain: as they came


def test_a_step_sends_the_deltas_of_requests_with_a_client_in_that_client_s_share():
    """Protocol 11: a request whose client the coordinator named travels in its client's share (a whole STEP_TOKENS
    message, finished ones named), unless its delta is one the coordinator reads (here: prompt scores); the others
    travel one by one as before."""
    done = FinalRecord(request_id="a2", status=RequestStatus.COMPLETED)
    outputs = [StepOutput("a1", [1], [], False), StepOutput("b1", [2], [], False),
               StepOutput("a2", [3], [], True, final=done), StepOutput("loose", [4], [], False),
               StepOutput("a3", [5], [], False, cached_tokens=0, prompt_scores=scored("x", 2).prompt_scores)]
    routes = {"a1": ("ca", "x1"), "a2": ("ca", 7), "a3": ("ca", "x3"), "b1": ("cb", "y1")}
    [body] = step_bodies("e", outputs, routes)
    assert [d.request_id for d in body.outputs] == ["loose", "a3"] and body.plain_ids == ["loose"]
    assert set(body.records) == {"a2"}
    assert [(s.client_id, s.request_ids, s.finished) for s in body.shares] == [
        ("ca", ["a1", "a2"], ["a2"]), ("cb", ["b1"], [])]
    step_tokens = decode(body.shares[0].frame, FROM_COORDINATOR)
    assert step_tokens.header is Header.STEP_TOKENS and step_tokens.body.client_request_ids == ["x1", 7]
    assert [d.new_tokens for d in step_tokens.body.deltas] == [[1], [3]]
    assert [b.shares for b in step_bodies("e", outputs)] == [[]]  # no routes: no shares
