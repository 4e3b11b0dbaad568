"""A pending request's failure reaches its caller once, with its own traceback, and leaves nothing for asyncio
to complain about.

A stream's caller reads its queue; the request's future is never awaited. Failed and left unread, each
such future logged "Future exception was never retrieved" when collected (one per stream a lost
coordinator ended), and on Python 3.11 that log, drawn by the collector in the middle of another
``ast.parse``, made the parse raise ``SystemError`` in an unrelated test.
"""

from __future__ import annotations

import asyncio
import gc
import traceback

import msgspec

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.pending_requests import PendingRequest, PendingRequests
from megatron_serve.client.streams import iterate_stream
from megatron_serve.wire.connection import CoordinatorLost
from megatron_serve.wire.deltas import TokenDelta
from megatron_serve.wire.request import FinalRecord, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams


def _pending(loop: asyncio.AbstractEventLoop, stream: bool) -> PendingRequest:
    params = SamplingParams(num_tokens_to_generate=4)
    return PendingRequest("r", [1, 2, 3], params, stream, loop.create_future(),
                          OutputCollector("r", [1, 2, 3], params, None), asyncio.Queue() if stream else None)


def _complaints_after_failing(stream: bool) -> tuple[list[dict], BaseException | None]:
    loop = asyncio.new_event_loop()
    complaints: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: complaints.append(context))
    try:
        pending = _pending(loop, stream)
        pending.fail(CoordinatorLost("lost the coordinator at tcp://127.0.0.1:1"))
        delivered = pending.queue.get_nowait() if stream else None
        del pending
        gc.collect()
        return complaints, delivered
    finally:
        loop.close()


def test_a_failed_stream_delivers_its_error_on_the_queue_and_leaves_no_unretrieved_future():
    complaints, delivered = _complaints_after_failing(stream=True)
    assert isinstance(delivered, CoordinatorLost)
    assert complaints == []


def test_a_failed_whole_request_nobody_awaited_is_still_reported():
    """The control: a future its caller dropped unread is the caller's to hear about."""
    complaints, _ = _complaints_after_failing(stream=False)
    assert [c["message"] for c in complaints] == ["Future exception was never retrieved"]


def test_one_error_ending_many_streams_gives_each_its_own_traceback():
    """fail_all puts one error in every stream's queue; each stream raises it with its own frames only."""
    async def depths() -> list[int]:
        error = CoordinatorLost("lost the coordinator at tcp://127.0.0.1:1")
        found = []
        for _ in range(4):
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(error)
            try:
                async for _item in iterate_stream(queue, lambda: None):
                    pass
            except CoordinatorLost as exc:
                found.append(len(traceback.extract_tb(exc.__traceback__)))
        return found

    found = asyncio.run(depths())
    assert len(set(found)) == 1, found  # without a fresh traceback per raise: 2, 4, 6, 8 frames


def test_a_final_record_builds_the_result_once_and_one_that_does_not_parse_fails_its_request_alone():
    """The record says how the request went; the prompt and tokens are this side's. A record that does not parse
    fails its request saying why (the others go on), with what this side has of it."""
    loop = asyncio.new_event_loop()
    try:
        requests = PendingRequests()
        good, bad = _pending(loop, stream=False), _pending(loop, stream=False)
        bad.request_id = "s"
        requests.add(good)
        requests.add(bad)
        good.collector.add(TokenDelta(new_tokens=[7, 8]))
        record = FinalRecord(request_id="c/r", status=RequestStatus.COMPLETED, finish_reason=FinishReason.LENGTH)
        done = requests.on_final("r", msgspec.Raw(msgspec.msgpack.encode(record)))
        assert done is good.future.result() and done.status is RequestStatus.COMPLETED and done.request_id == "r"
        assert (done.prompt_tokens, done.generated_tokens, done.finish_reason) == ([1, 2, 3], [7, 8], "length")
        failed = requests.on_final("s", msgspec.Raw(msgspec.msgpack.encode({"status": "DONE"})))
        assert failed is bad.future.result() and failed.status is RequestStatus.FAILED and failed.prompt_tokens == [1, 2, 3]
        assert failed.error.startswith("unreadable result from the coordinator: ") and len(requests) == 0
    finally:
        loop.close()
