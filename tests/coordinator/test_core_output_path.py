"""The coordinator on the output path (protocol 6): token ids to every client, records without them.

The client makes the text and finds stop strings, so every request's tokens reach it as they come
(streamed or not), the ``RESULT`` record does not repeat them, and a client that reconnects gets
every token it missed again, whole (a ``STEP_TOKENS`` catch-up). A client below protocol 6 is
refused at ``SUBMIT`` instead of getting results without it.
"""

from __future__ import annotations

import msgspec
import numpy as np

from megatron_serve.engine.output import plain_first
from megatron_serve.wire.expert_routing import routing_to_wire
from megatron_serve.wire.messages import PROTOCOL_VERSION, EngineStep, Hello, PromptScores, RoutingRows, RequestDelta, Submit
from megatron_serve.wire.protocol import ErrorCode, Header

from .core_harness import CoreHarness
from .test_core import C, E1, submit

SLIM = {"request_id": "c1/r", "prompt_tokens": [1, 2, 3], "status": "COMPLETED", "finish_reason": "length"}


def send_step(h: CoreHarness, engine_id: str, *outputs: RequestDelta, record: dict | None = None,
              plain: bool = True) -> None:
    """An engine's step of ``outputs``, as an engine's link builds it (:func:`plain_first`: the plain deltas first,
    named); ``record``: the final record of the finished one, beside the deltas; ``plain=False``: as an engine of
    protocol 8 sent it (no ``plain_ids``, every output read one by one)."""
    records = {} if record is None else {"c1/r": msgspec.Raw(msgspec.msgpack.encode(record))}
    body = plain_first(engine_id, list(outputs), {})
    h.send(E1, Header.ENGINE_STEP, EngineStep(
        engine_id=engine_id, records=records, plain_ids=body.plain_ids if plain else [],
        outputs=[msgspec.Raw(msgspec.msgpack.encode(out)) for out in (body.outputs if plain else outputs)]))


def delta(tokens: list[int], finished: bool = False, **fields) -> RequestDelta:
    return RequestDelta(request_id="c1/r", new_tokens=tokens, finished=finished, **fields)


def dispatched(**params) -> tuple[CoreHarness, str]:
    """A core with client ``C`` and engine ``E1``, request ``r`` submitted (``params``: :func:`submit`'s) and sent
    to ``E1``; the core and the engine's id."""
    h = CoreHarness()
    h.client(C)
    e1 = h.engine(E1, group=0)
    submit(h, "r", **params)
    assert h.take(E1, Header.ENGINE_SUBMIT)
    return h, e1


def test_a_request_that_is_not_streamed_gets_its_tokens_and_a_record_without_them():
    h, e1 = dispatched(tokens=3, stream=False)
    send_step(h, e1, delta([5], new_log_probs=[-0.5], top_ids=[[5, 9]], top_log_probs=[[-0.5, -1.5]],
                           epochs=[[0], [0]], cached_tokens=0))
    send_step(h, e1, delta([6], epochs=[[0], [0]]))
    send_step(h, e1, delta([7], finished=True), record=SLIM)
    sent = h.take(C)
    assert [type(b).__name__ for b in sent] == ["ClientDelta", "ClientDelta", "ClientDelta", "Result"]
    first = sent[0]
    assert (first.new_tokens, first.new_log_probs, first.top_ids, first.top_log_probs) == (
        [5], [-0.5], [[5, 9]], [[-0.5, -1.5]])
    assert [t.new_tokens for t in sent[:3]] == [[5], [6], [7]]
    assert sent[3].request == SLIM  # forwarded as the engine sent it


def test_a_reconnected_client_gets_every_token_it_missed_with_what_went_with_them():
    h, e1 = dispatched(tokens=8, stream=True)
    rows = np.arange(8, dtype=np.uint8).reshape(4, 1, 2)
    scores = PromptScores(log_probs=[-1.0, -2.0])
    send_step(h, e1, delta([5], new_log_probs=[-0.5], epochs=[[3], [2]], cached_tokens=1, prompt_scores=scores,
                           routing=RoutingRows(start=0, **routing_to_wire(rows[:3])), top_p_token_ids=[[5, 2]]))
    send_step(h, e1, delta([6, 7], new_log_probs=[-0.6, -0.7], epochs=[[3, 3], [2, 2]],
                           routing=RoutingRows(start=3, **routing_to_wire(rows[3:])),
                           top_p_token_ids=[[6, 1], [7]]))
    h.take(C)
    h.send(C, Header.HELLO, Hello(role="client", client_id="c1", acks=True, protocol=PROTOCOL_VERSION))  # it reconnects
    h.take(C, Header.HELLO_ACK)
    params = msgspec.Raw(msgspec.msgpack.encode({"num_tokens_to_generate": 8}))
    h.send(C, Header.SUBMIT, Submit(client_request_id="r", prompt=[1, 2, 3], sampling_params=params, stream=True,
                                    generated_tokens=[5]))  # it had only the first
    [resent] = h.take(C, Header.STEP_TOKENS)
    # an engine that sent no adapter versions: -1 (unknown) in the third list
    assert (resent.new_tokens, resent.new_log_probs, resent.epochs) == ([6, 7], [-0.6, -0.7],
                                                                        [[3, 3], [2, 2], [-1, -1]])
    assert resent.cached_tokens == 1 and resent.prompt_scores == scores and resent.routing.start == 0
    assert resent.top_p_token_ids == [[6, 1], [7]]  # return_top_p_token_ids: each token's kept ids
    assert np.array_equal(np.frombuffer(resent.routing.data, np.uint8).reshape(4, 1, 2), rows)


def test_a_text_prompt_is_refused_with_an_error_naming_it_the_coordinator_tokenizes_nothing():
    h = CoreHarness()
    h.client(C)
    h.engine(E1, group=0)
    h.send(C, Header.SUBMIT, Submit(client_request_id="r", prompt="a bb ccc"))
    error = h.take(C, Header.ERROR)[0]
    assert error.code == ErrorCode.INVALID_REQUEST.value and error.client_request_id == "r"
    assert "text prompt" in error.message and "loads no tokenizer" in error.message
    assert not h.take(E1, Header.ENGINE_SUBMIT) and not h.core.flow.table.records
    h.send(C, Header.SUBMIT, Submit(client_request_id="ids", prompt=[1, 2, 3]))  # the control: ids are served
    assert h.take(E1, Header.ENGINE_SUBMIT)[0].request["prompt_tokens"] == [1, 2, 3]


def test_a_final_step_without_tokens_still_brings_the_prompt_scores():
    h, e1 = dispatched()
    scores = PromptScores(log_probs=[-1.0, -2.0])
    send_step(h, e1, delta([], finished=True, prompt_scores=scores), record=SLIM)
    tokens, result = h.take(C)
    assert tokens.new_tokens == [] and tokens.prompt_scores == scores and result.client_request_id == "r"


def test_a_client_that_cannot_make_text_is_refused_at_submit():
    h = CoreHarness()
    h.send(C, Header.HELLO, Hello(role="client", client_id="old", acks=True, protocol=3))
    h.take(C, Header.HELLO_ACK)
    h.engine(E1, group=0)
    submit(h, "r")
    [error] = h.take(C, Header.ERROR)
    assert error.code == "unsupported" and error.client_request_id == "r" and "protocol 3" in error.message
    assert not h.take(E1, Header.ENGINE_SUBMIT) and len(h.core.flow.table) == 0
