"""What tells a request that its client left (``streaming.Departure``) or that the server stops (``drain.Stopping``):
callbacks instead of a task each, so what matters is when they fire and that a forgotten one never does (a
cancellation that arrived after its request moved on would cancel whatever the task does next)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_serve.server.drain import Stopping
from megatron_serve.server.streaming import Departure

pytestmark = pytest.mark.timeout(30)


async def test_stopping_calls_back_once_on_the_next_turn_unless_forgotten():
    stopping = Stopping()
    calls: list[str] = []
    stopping.on_set(lambda: calls.append("a"))
    forget_b = stopping.on_set(lambda: calls.append("b"))
    stopping.set()
    assert calls == [] and stopping.is_set()  # as a task waiting on the event: woken on a later turn
    forget_b()  # forgotten after the set, before its turn: never called
    stopping.set()  # a second set calls nobody again
    await asyncio.sleep(0)
    assert calls == ["a"]
    stopping.on_set(lambda: calls.append("late"))  # registered once set: called soon
    forget_never = stopping.on_set(lambda: calls.append("never"))
    forget_never()
    await asyncio.sleep(0)
    assert calls == ["a", "late"]
    assert await asyncio.wait_for(stopping.wait(), 1)  # still an asyncio.Event to wait on


class Channel:
    """An ASGI ``receive`` whose messages the test sends."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict] = asyncio.Queue()

    async def __call__(self) -> dict:
        return await self.queue.get()


async def test_departure_cancels_the_tasks_it_watches_for_only_while_they_are_watched():
    channel = Channel()
    departure = Departure({}, channel)
    watched = asyncio.create_task(asyncio.sleep(30))
    moved_on = asyncio.create_task(asyncio.sleep(30))
    departure.cancel_on_leave(watched)
    forget = departure.cancel_on_leave(moved_on)
    channel.queue.put_nowait({"type": "http.request", "body": b"", "more_body": False})  # not a departure
    await asyncio.sleep(0.01)
    assert not departure.left and not watched.done()
    channel.queue.put_nowait({"type": "http.disconnect"})
    await asyncio.sleep(0)  # the watcher has the message; its callback is due on a later turn
    forget()  # the request moved on before that turn: its task must not be cancelled
    await asyncio.sleep(0.01)
    assert departure.left and watched.cancelled()
    assert not moved_on.done()
    moved_on.cancel()
    departure.close()


async def test_a_closed_departure_cancels_nothing():
    channel = Channel()
    departure = Departure({}, channel)
    task = asyncio.create_task(asyncio.sleep(30))
    departure.cancel_on_leave(task)
    departure.close()
    channel.queue.put_nowait({"type": "http.disconnect"})
    await asyncio.sleep(0.01)
    assert not departure.left and not task.done()
    task.cancel()


async def test_the_server_protocol_tells_a_departure_itself_without_a_task():
    """Under the server's own protocol the request's ``ChunkedBody`` carries the departure: no task waits on
    ``receive``, and the protocol's word (``told_left``) cancels what is watched; a closed departure is forgotten."""
    from megatron_serve.server.chunked import EXTENSION, ChunkedBody, told_left

    class Cycle:  # what a request-response cycle of uvicorn's has that the body writer reads
        def __init__(self) -> None:
            self.transport = self.flow = None
            self.disconnected = self.response_complete = False
            self.scope = {}
            self.scope["extensions"] = {EXTENSION: ChunkedBody(self)}

    cycle = Cycle()

    async def never() -> dict:
        raise AssertionError("nothing reads receive")

    tasks = len(asyncio.all_tasks())
    departure = Departure(cycle.scope, never)
    assert len(asyncio.all_tasks()) == tasks  # no watcher
    watched = asyncio.create_task(asyncio.sleep(30))
    departure.cancel_on_leave(watched)
    cycle.disconnected = True
    told_left(cycle)
    await asyncio.sleep(0)
    assert departure.left and watched.cancelled()
    departure.close()
    late = Departure(cycle.scope, never)  # its client had left already
    assert not late.left
    await asyncio.sleep(0)  # it learns on the next turn, as a watcher would
    assert late.left
    other = Cycle()
    forgotten = Departure(other.scope, never)
    forgotten.close()
    other.disconnected = True
    told_left(other)
    assert not forgotten.left
