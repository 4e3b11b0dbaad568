"""A reconnected client's catch-up is cut between tokens by the rule that cuts an engine's step
(``wire/frame_cuts.py``), so kept ids (``return_top_p_token_ids``: up to the vocabulary per token) that pass one frame
still reach the client whole.

Before, the catch-up was one ``STEP_TOKENS`` holding every token the client missed: 64 tokens that kept 60,000 ids
each (ids past 65,535, 5 bytes each in msgpack) made a 19 MB message, which the coordinator's outbox cannot encode
within the 16 MiB frame: it logged it and sent nothing, and the client's result lacked the tokens lost with its old
socket. Driven through the coordinator's core and the client's own pending-request table.
"""

from __future__ import annotations

import asyncio

import msgspec

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.pending_requests import PendingRequest, PendingRequests
from megatron_serve.wire.frame_cuts import FRAME_ENTRIES, delta_pieces, token_entries
from megatron_serve.wire.messages import EngineStep, PromptScores, RequestDelta, RoutingRows, Submit, TokenDelta
from megatron_serve.wire.protocol import MAX_MESSAGE_BYTES, Header
from megatron_serve.wire.sampling_params import SamplingParams

from .core_harness import CoreHarness
from .test_core import final_record

OLD, NEW, ENGINE = b"client-old-socket", b"client-new-socket", b"engine-1"
TOKENS, KEPT = 64, 60_000


def kept_at(i: int) -> list[int]:
    """What token ``i`` kept: 60,000 ids of a 150k vocabulary, past 65,535 (5 bytes each)."""
    return list(range(70_000 + i, 70_000 + i + KEPT))


def test_a_catch_up_whose_kept_ids_pass_a_frame_reaches_the_client_in_pieces():
    assert TOKENS * KEPT * 5 > MAX_MESSAGE_BYTES  # the catch-up as one message would not fit
    h = CoreHarness(max_request_logprobs=TOKENS * KEPT)  # its 3.84 M kept ids within the budget
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(num_tokens_to_generate=TOKENS, temperature=0.8, top_p=0.99,
                                return_top_p_token_ids=True)
        pending = PendingRequests()
        request = PendingRequest("r", [1, 2, 3], params, False, loop.create_future(),
                                 OutputCollector("r", [1, 2, 3], params, None))
        pending.add(request)
        h.client(OLD)
        engine = h.engine(ENGINE)
        h.send(OLD, Header.SUBMIT, Submit(client_request_id="r", prompt=[1, 2, 3], stream=True,
                                          sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))
        submitted = h.take(ENGINE, Header.ENGINE_SUBMIT)[0].request
        for i in range(TOKENS - 1):
            delta = RequestDelta(request_id="c1/r", new_tokens=[70_000 + i], finished=False,
                                 top_p_token_ids=[kept_at(i)])
            h.send(ENGINE, Header.ENGINE_STEP, EngineStep(engine_id=engine, records={},
                                                          outputs=[msgspec.Raw(msgspec.msgpack.encode(delta))]))
            if i == 7:  # the client read its first 8 tokens; the rest went to the old socket and were lost with it
                for body in h.take(OLD, Header.STEP_TOKENS):
                    pending.on_delta(body.client_request_id, body)
                h.inbox.pop(OLD, None)
        h.inbox.pop(OLD, None)
        h.client(NEW)  # the same client id says HELLO again: every request's tokens from the first
        catch_up = h.take(NEW, Header.STEP_TOKENS)
        assert len(catch_up) > 1
        assert [body.start for body in catch_up] == [0] + [sum(len(b.new_tokens) for b in catch_up[:j])
                                                           for j in range(1, len(catch_up))]
        for body in catch_up:
            assert sum(map(len, body.top_p_token_ids)) <= FRAME_ENTRIES
            pending.on_delta(body.client_request_id, body, body.start)
        last = RequestDelta(request_id="c1/r", new_tokens=[70_000 + TOKENS - 1], finished=True,
                            top_p_token_ids=[kept_at(TOKENS - 1)])
        record = final_record(submitted, [70_000 + i for i in range(TOKENS)])
        h.send(ENGINE, Header.ENGINE_STEP, EngineStep(
            engine_id=engine, records={"c1/r": msgspec.Raw(msgspec.msgpack.encode(record))},
            outputs=[msgspec.Raw(msgspec.msgpack.encode(last))]))
        h.deliver(NEW, pending)
        assert request.future.done()
        result = request.future.result()
        assert result.generated_tokens == [70_000 + i for i in range(TOKENS)]
        assert result.generated_top_p_token_ids == [kept_at(i) for i in range(TOKENS)]
    finally:
        loop.close()


def test_a_delta_is_cut_between_tokens_with_what_goes_with_its_first_and_last_tokens():
    """The pieces of one delta: per-token lists that cover only its last tokens (a resubmission's own tokens came
    without them) stay with their tokens; prompt scores and cached tokens go with the first piece, the routing rows
    and the stop mark with the last; joined again they are the delta."""
    scores = PromptScores(log_probs=[-1.0] * 3)
    routing = RoutingRows(start=0, shape=[0, 1, 1], dtype="uint8", data=b"")
    delta = TokenDelta(new_tokens=list(range(10)), new_log_probs=[-0.5] * 6,
                       top_p_token_ids=[[i] * 4 for i in range(4, 10)], epochs=[[1] * 10, [2] * 10, [0] * 10],
                       cached_tokens=2, prompt_scores=scores, routing=routing, stop_token=True)
    assert token_entries(delta) == [3, 0, 0, 0, 4, 4, 4, 4, 4, 4]
    assert delta_pieces(delta, limit=100) == [(0, delta)]
    pieces = delta_pieces(delta, limit=8)
    assert [(offset, piece.new_tokens) for offset, piece in pieces] == [(0, [0, 1, 2, 3, 4]), (5, [5, 6]),
                                                                        (7, [7, 8]), (9, [9])]
    first, *middle, last = (piece for _, piece in pieces)
    assert (first.prompt_scores, first.cached_tokens, first.routing, first.stop_token) == (scores, 2, None, False)
    assert (last.prompt_scores, last.cached_tokens, last.routing, last.stop_token) == (None, None, routing, True)
    assert first.top_p_token_ids == [[4] * 4] and first.new_log_probs == [-0.5]
    assert [t for _, p in pieces for t in p.top_p_token_ids] == delta.top_p_token_ids
    assert [v for _, p in pieces for v in p.new_log_probs] == delta.new_log_probs
    assert [[e for _, p in pieces for e in p.epochs[k]] for k in range(3)] == delta.epochs
