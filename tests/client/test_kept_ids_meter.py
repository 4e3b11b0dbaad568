"""A request's kept ids (``return_top_p_token_ids``) counted where its deltas arrive, by one meter for all its choices
(``limits.KeptIdsMeter`` on the client's pending requests, as the HTTP server hands it in).

The budget is per request, total over its choices, as the request's up-front count is (SGLang's and vLLM's request
limits cap a request, not one of its sequences): two choices of 100 + 100 ids fit a budget of 250, and a third
hundred, on either, ends the request; the other choice ends at its next step. A meter per choice (the control: how
they were counted before) lets both go on. The same meter charges the ids' bytes against the answer's estimate
(``--max-response-bytes``), beside the log-prob budget: 101 ids past a room of 100 end the request naming that
budget; without a bytes budget (the control) they do not. Each ends as a coordinator ends one: FAILED, reason
``length``, its tokens so far, the error naming the budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.pending_requests import PendingRequest, PendingRequests
from megatron_serve.limits import KEPT_ID_BYTES, Cost, KeptIdsMeter, engine_request_cost
from megatron_serve.wire.deltas import TokenDelta
from megatron_serve.wire.request import FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams

PARAMS = SamplingParams(num_tokens_to_generate=16, temperature=0.8, top_p=0.9, return_top_p_token_ids=True)
OPTION = "--max-request-logprobs"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


def _table(loop: asyncio.AbstractEventLoop, meters: dict[str, KeptIdsMeter]) -> PendingRequests:
    table = PendingRequests()
    for request_id, meter in meters.items():
        table.add(PendingRequest(request_id, [1, 2, 3], PARAMS, False, loop.create_future(),
                                 OutputCollector(request_id, [1, 2, 3], PARAMS, None), meter=meter))
    return table


def _kept(token: int, count: int) -> TokenDelta:
    return TokenDelta(new_tokens=[token], top_p_token_ids=[list(range(count))])


def _ended(table: PendingRequests, request_id: str, delta: TokenDelta) -> PendingRequest | None:
    return table.on_delta(request_id, delta)


def test_two_choices_share_one_budget_and_both_end_once_their_ids_together_pass_it(loop):
    shared = KeptIdsMeter(Cost(), 250, OPTION, choices=2)
    table = _table(loop, {"a": shared, "b": shared})
    assert _ended(table, "a", _kept(11, 100)) is None
    assert _ended(table, "b", _kept(21, 100)) is None  # 200 of 250
    ended = _ended(table, "a", _kept(12, 100))  # 300: the request is over, whichever choice passed it
    assert ended is not None and ended.request_id == "a"  # the caller aborts it where it runs
    result = ended.future.result()
    assert (result.status, result.finish_reason) == (RequestStatus.FAILED, FinishReason.LENGTH)
    assert result.generated_tokens == [11, 12]  # its tokens so far, this step's included
    assert f"budget of 250 per request ({OPTION})" in result.error
    assert "300 top-p token ids in 3 new tokens of its 2 choices" in result.error
    other = _ended(table, "b", _kept(22, 1))  # the other choice ends at its next step
    assert other is not None and other.future.result().error == result.error

    apart = _table(loop, {"a": KeptIdsMeter(Cost(), 250, OPTION), "b": KeptIdsMeter(Cost(), 250, OPTION)})
    for request_id, token in (("a", 11), ("b", 21), ("a", 12), ("b", 22)):  # the control: counted per choice
        assert _ended(apart, request_id, _kept(token, 100)) is None


def test_kept_ids_count_against_the_answer_bytes_as_they_arrive(loop):
    cost = engine_request_cost(3, PARAMS)  # 16 tokens' text up front, no log probs
    room = cost.answer_bytes + 100 * KEPT_ID_BYTES
    table = _table(loop, {"r": KeptIdsMeter(cost, 1 << 20, OPTION, max_bytes=room)})
    assert _ended(table, "r", _kept(11, 60)) is None
    assert _ended(table, "r", _kept(12, 40)) is None  # 100 ids: the answer's estimate at its budget
    ended = _ended(table, "r", _kept(13, 1))
    assert ended is not None
    error = ended.future.result().error
    assert f"budget of {room:,} bytes per answer (--max-response-bytes)" in error, error
    assert f"101 top-p token ids in 3 new tokens, about {cost.answer_bytes + 101 * KEPT_ID_BYTES:,} bytes" in error

    control = _table(loop, {"r": KeptIdsMeter(cost, 1 << 20, OPTION)})  # no bytes budget: the log probs' alone
    for token, count in ((11, 60), (12, 40), (13, 1)):
        assert _ended(control, "r", _kept(token, count)) is None


def test_a_resubmission_carries_the_kept_ids_already_delivered(loop):
    table = _table(loop, {"r": KeptIdsMeter(Cost(), 1 << 20, OPTION)})
    pending = table.get("r")
    assert "kept_ids" not in pending.submit_body()
    _ended(table, "r", _kept(11, 60))
    _ended(table, "r", _kept(12, 40))
    body = pending.submit_body()  # after a coordinator restart: it goes on from its tokens, its ids still counted
    assert (body["generated_tokens"], body["kept_ids"]) == ([11, 12], 100)
