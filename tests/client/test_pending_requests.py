"""A pending request's failure reaches its caller once, and leaves nothing for asyncio to complain about.

A stream's caller reads its queue; the request's future is never awaited. Failed and left unread, each
such future logged "Future exception was never retrieved" when collected (one per stream a lost
coordinator ended), and on Python 3.11 that log, drawn by the collector in the middle of another
``ast.parse``, made the parse raise ``SystemError`` in an unrelated test.
"""

from __future__ import annotations

import asyncio
import gc

from megatron_serve.client.output_processor import OutputCollector
from megatron_serve.client.pending_requests import PendingRequest
from megatron_serve.wire.connection import CoordinatorLost
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
