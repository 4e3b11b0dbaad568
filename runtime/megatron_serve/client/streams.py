"""Turning a queue of streamed items into an async iterator that aborts its request when abandoned."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Protocol

from ..wire.request import DynamicInferenceRequest


class Sink(Protocol):
    """Where a stream's items go as they arrive (``InferenceClient.add_request_streaming_to``; a queue is one)."""

    def put_nowait(self, item: Any) -> None: ...


class TextSink(Sink, Protocol):
    """A sink that also takes a plain stream's new text alone (a stream with nothing but text to show: no log probs,
    stop strings or token listings), so that no :class:`~.outputs.StreamPartial` is made for it per token.

    ``put_text`` returns False when it cannot show the text alone (the stream's first piece, or an answer that wants
    the whole piece): the piece then goes to ``put_nowait`` as usual."""

    def put_text(self, text: str) -> bool: ...


async def iterate_stream(items: asyncio.Queue, abandon: Callable[[], None]) -> AsyncIterator[Any]:
    """Yield partials until the final ``DynamicInferenceRequest`` (or raise the error put in its place).

    Leaving the loop before the end (``break``, cancellation) calls ``abandon``, which aborts the request.
    """
    finished = False
    try:
        while True:
            item = await items.get()
            if isinstance(item, BaseException):
                finished = True
                # One error ends every stream a lost coordinator held (the same instance in each queue): raised
                # with a traceback of its own here, or each stream's raise appended its frames to the last one's
                # (a log of 64 streams printed every stream's frames 64 times over).
                raise item.with_traceback(None)
            if isinstance(item, DynamicInferenceRequest):
                finished = True
                yield item
                return
            yield item
    finally:
        if not finished:
            abandon()
