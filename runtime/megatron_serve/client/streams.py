"""Turning a queue of streamed items into an async iterator that aborts its request when abandoned, and the
inbox where a server's submission gathers the items of its streams."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Protocol

from ..wire.request import DynamicInferenceRequest


class Sink(Protocol):
    """Where a stream's items go as they arrive (``InferenceClient.add_request_streaming_to``; a queue is one)."""

    def put_nowait(self, item: Any) -> None: ...


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


class Inbox:
    """A sink whose reader takes everything that arrived since it last looked, in one wake-up.

    The receive loop files a step's items for many streams in one pass; an ``asyncio.Queue`` cost
    its reader a ``get`` (a loop of checks and a waiter hand-off) per item, about 7% of the HTTP
    server's profile at 64 streams. Here a reader that finds items takes them all without waiting,
    and a waiting reader is woken once however many arrive before it runs.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def idle(self) -> bool:
        """The reader waits and nothing is filed: it has handled everything that came (what it was handed is
        written), so an item handled outside it now keeps the order."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._items

    async def take(self) -> list[Any]:
        """Every item that arrived, in order (waits for one when there is none)."""
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items
