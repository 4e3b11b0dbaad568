"""Server-sent events, and answering a request only while its client is still there.

Two problems that both routes share:

* A streamed answer must still be able to fail with a proper status code (400, 429, 503) when
  the problem shows before the first token, so :func:`event_stream_response` waits for the first
  event before sending headers; problems after that become an ``error`` event in the stream
  (:func:`openai_events`, which also ends every stream with ``[DONE]``).
* A client that leaves must not leave work behind. A :class:`Departure` watches the ASGI ``receive``
  channel from the moment the body is read: :func:`cancel_on_disconnect` cancels the wait for the
  answer when the client disconnects (the cancellation aborts the engine requests), and the
  :class:`EventStreamResponse` that follows cancels its stream, with the same effect, as Starlette's
  streaming response does. Either way the departure is logged once, at debug level: clients leave
  all the time, it is no error of the server's.
* A server that stops answers what it holds: the wait is cancelled with a 503 (a stream that
  already started gets an error event and ``[DONE]`` from its submission), never uvicorn's
  plain-text 500 after its graceful-shutdown timeout.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from .chunks import sse
from .chunked import ChunkedWriter, chunked_writer
from .drain import Stopping
from .errors import APIError, shutting_down

logger = logging.getLogger("megatron_serve.server")

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
#: The server's own ``send`` of the request this task answers (see :class:`EventStreamResponse`).
_RAW_SEND: ContextVar[Send | None] = ContextVar("megatron_serve_raw_send", default=None)
#: Events a stream writes before it lets the loop run (below asyncio's and uvloop's threshold of 5 writes
#: into a lost connection before they log).
_WRITES_PER_TURN = 4
#: Status logged for requests whose client left before the answer (nginx's convention; nobody receives it).
CLIENT_CLOSED = 499


def client_closed() -> JSONResponse:
    return JSONResponse({"error": {"message": "client closed the request", "type": "client_closed", "param": None,
                                   "code": None}}, status_code=CLIENT_CLOSED)


async def read_body(request: Request) -> bytes | None:
    """The whole request body, or None when the client left while sending it (logged once, at debug)."""
    try:
        return await request.body()
    except ClientDisconnect:
        logger.debug("client %s left %s while sending its body", _peer(request), request.url.path)
        return None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Departure:
    """Whether the client of one request left: one task waiting for its ``http.disconnect``, shared by the wait for
    the answer (:func:`cancel_on_disconnect`) and the stream that follows (:class:`EventStreamResponse`), which
    each had their own, beside a task for the work and one waiting for the server to stop."""

    __slots__ = ("_watcher", "_cancel", "left")

    def __init__(self, receive: Receive) -> None:
        self._cancel: set[asyncio.Task[Any]] = set()  # tasks to cancel when the client leaves
        self.left = False  # the client left (and the tasks to cancel then were cancelled)
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._leave)

    def _leave(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():
            self.left = True
            for task in self._cancel:
                task.cancel()

    def cancel_on_leave(self, task: asyncio.Task[Any]) -> Callable[[], None]:
        """Cancel ``task`` when the client leaves, until the returned function is called."""
        self._cancel.add(task)
        return lambda: self._cancel.discard(task)

    def close(self) -> None:
        self._cancel.clear()
        self._watcher.cancel()


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]],
                               stopping: Stopping) -> T | Response:
    """Await ``work()`` in this task; if the client disconnects first, cancel it and return a 499 nobody will read;
    if the server stops first (``stopping``), cancel it and answer 503. An :class:`EventStreamResponse` that ``work``
    returns takes over the watch for the client leaving."""
    task = asyncio.current_task()
    assert task is not None
    departure = Departure(request.receive)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    forget_leave = departure.cancel_on_leave(task)
    forget_stop = stopping.on_set(stop)
    handed_over = False
    try:
        result = await work()
        if isinstance(result, EventStreamResponse):
            result.departure, handed_over = departure, True
        return result
    except asyncio.CancelledError:
        if not (stopped or departure.left) or task.uncancel() > 0:
            raise  # not ours: whoever cancelled this task gets it
        if not departure.left:
            return shutting_down().response()
        logger.debug("client %s left %s before its answer: its engine requests are aborted",
                     _peer(request), request.url.path)
        return client_closed()
    finally:
        forget_leave()
        forget_stop()
        if not handed_over:
            departure.close()


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


class Renderer(Protocol[T]):
    """What makes an answer's events: ``item`` those of one arrived item, ``end`` those after the last one."""

    def item(self, job: Any, item: T) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...


class Submitted(Protocol[T]):
    """A submission's side of a stream (``server.generation.Submission``): its items, and where pieces may go
    without waking the task that reads them."""

    bypass: Any
    ending: bool  # the item the stream yields now is its last

    def stream(self) -> AsyncGenerator[tuple[Any, T], None]: ...


class _Last(bytes):
    """The last events of a stream (what follows the last item, and ``[DONE]``): written with the end of the body."""


async def openai_events(items: AsyncGenerator[tuple[Any, T], None], render: Renderer[T],
                        ending: Callable[[], bool] = lambda: False) -> AsyncIterator[bytes]:
    """The events ``render`` makes of ``items``, framed as an OpenAI stream; closing it closes ``items``.

    An :class:`APIError` before the first event is raised, so that the answer can still be that
    error with its status code; after it the status line is sent, so the error becomes an OpenAI
    error event, and ``data: [DONE]`` ends the stream either way, as OpenAI clients expect.
    ``items`` is closed however the stream ends (finished, failed, or closed or cancelled because
    the client left), which for a submission's stream aborts its unfinished engine requests.

    The events of one item come as one piece of bytes, and those of the last item (``ending()`` says which it
    is), what follows it and ``[DONE]`` as one :class:`_Last`: each a write into the connection (a system call)
    instead of one per event, the last one with the end of the body. A streamed request of 2 tokens with its
    usage made 7 writes, now 4; the bytes on the wire are the same events.
    """
    started = False
    last: list[bytes] = []
    try:
        async for job, item in items:
            events = render.item(job, item)
            if ending():
                last = events
                break
            if events:
                started = True
                yield events[0] if len(events) == 1 else b"".join(events)
        yield _Last(b"".join([*last, *render.end(), DONE]))
    except APIError as exc:
        if not started:
            raise
        yield _Last(sse(exc.body()) + DONE)
    finally:
        await items.aclose()


class _DirectWrites:
    """A submission's bypass (``Submission.deliver``): each piece's events made and written into the connection
    at once, by whoever delivers it (the client's receive loop)."""

    __slots__ = ("_item", "_write", "ready")

    def __init__(self, render: Renderer[Any], writer: ChunkedWriter) -> None:
        self._item = render.item
        self._write = writer.write_now
        self.ready = writer.ready  # (bound once: the receive loop asks it for every piece)

    def take(self, job: Any, item: Any) -> None:
        events = self._item(job, item)
        if events:
            self._write(events[0] if len(events) == 1 else b"".join(events))


async def stream_answer(submission: Submitted[T], render: Renderer[T], answer_id: str) -> "EventStreamResponse":
    """The streamed answer of ``submission``, its events made by ``render``: an :class:`EventStreamResponse`
    whose pieces, once the stream runs, are written by the client's receive loop in its pass over a step (no
    task wake-up, async generators or awaited write per stream and step; 94% of the chunks at 64 streams).
    Server CPU per 1,000 streamed tokens, ``benchmarks/serving.py`` c64 staggered, runs alternated on a loaded
    2-core machine: 60, 62, 62 -> 49, 54, 50 with protocol 5's ``STEP_TOKENS`` (docs/benchmarks.md).
    """
    def divert(writer: ChunkedWriter | None) -> None:
        submission.bypass = None if writer is None else _DirectWrites(render, writer)

    return await event_stream_response(openai_events(submission.stream(), render, lambda: submission.ending),
                                       answer_id, divert)


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that writes its events straight to the server's connection.

    The status line and the end of the body go through the app's middleware (which records the
    status and whether the answer started); the events between them go to the server's own
    ``send`` (which :func:`with_raw_send` keeps for the request's task) when it is there. Through
    the middleware each event was four more coroutine calls (the error middleware, two exception
    handler wrappers and the metrics middleware), none of which looks at a body; with the generator
    that fed Starlette's loop they were about 12% of the HTTP server's profile at 64 streams. With the
    one-call decode of a step's frame (``wire.protocol.decode_all``): server CPU per 1,000 streamed tokens
    89/89 -> 79/73 ms (``benchmarks/serving.py`` tiny model, c64 staggered, 512 requests, runs alternated
    on a loaded 2-core machine).
    """

    def __init__(self, first: bytes | None, events: AsyncIterator[bytes], answer_id: str,
                 divert: Callable[[ChunkedWriter | None], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._first = first
        self._events = events
        self._answer_id = answer_id
        self._divert = divert
        self.departure: Departure | None = None  # the watch for the client leaving, when the wait had one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream in this task while a :class:`Departure` waits for the client to leave (and then cancels it).

        Starlette runs both in an anyio task group (the server says ASGI 2.3), whose cancel scopes cost a few
        percent of the HTTP server's samples at 64 streams, per request. The behaviour is Starlette's: a
        client that leaves cancels the stream (which closes the events, aborting their engine requests) and
        the call returns normally.
        """
        task = asyncio.current_task()
        assert task is not None
        departure = self.departure or Departure(receive)
        forget = departure.cancel_on_leave(task)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not departure.left or task.uncancel() > 0:
                raise
            # the departure's own cancellation, not the caller's: answered, as Starlette does
        finally:
            forget()
            departure.close()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        raw_send = _RAW_SEND.get() or send
        direct = chunked_writer(raw_send)
        ended = False
        last = b""  # the last events, sent with the end of the body (one write)
        written = 0
        try:
            if type(self._first) is _Last:  # nothing but the last events
                last = self._first
            elif self._first is not None:
                await raw_send({"type": "http.response.body", "body": self._first, "more_body": True})
            if direct is not None and self._divert is not None and not last:
                self._divert(direct)  # the pieces to come may be written without this task (stream_answer)
            while not last:
                try:
                    event = await self._events.__anext__()
                except StopAsyncIteration:
                    break
                if type(event) is _Last:
                    last = event
                    break
                # Let the loop run between writes, every few: events that arrived together would otherwise all
                # be written before the loop notices a client that left, each into a dead socket (asyncio
                # logged "socket.send() raised exception." hundreds of times per stream left; it logs from
                # the fifth write). A turn per event was a task wake-up per streamed chunk.
                written += 1
                if written % _WRITES_PER_TURN == 0:
                    await asyncio.sleep(0)
                if direct is None:
                    await raw_send({"type": "http.response.body", "body": event, "more_body": True})
                else:
                    await direct.write(event)
            ended = True
        finally:
            if self._divert is not None:
                self._divert(None)
            if not ended:
                logger.debug("the client of %s left its stream: its engine requests are aborted", self._answer_id)
            await self._events.aclose()
        await send({"type": "http.response.body", "body": bytes(last), "more_body": False})


async def event_stream_response(events: AsyncIterator[bytes], answer_id: str,
                                divert: Callable[[ChunkedWriter | None], None] | None = None) -> EventStreamResponse:
    """A ``text/event-stream`` response whose first event already exists (see the module docstring).

    ``events`` must raise :class:`APIError` for problems before its first event and turn later
    ones into error events itself (as :func:`openai_events` does). ``divert`` is told the connection's
    :class:`ChunkedWriter` once the stream runs, and None when it ends (see :func:`stream_answer`).
    """
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    return EventStreamResponse(first, events, answer_id, divert)


def with_raw_send(app: ASGIApp) -> ASGIApp:
    """``app`` that keeps the server's own ``send`` of each HTTP request for :class:`EventStreamResponse`
    (in a context variable: uvicorn answers each request in a task of its own, and the tasks the app
    starts for it copy its context); the server runs this outside every middleware."""
    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            _RAW_SEND.set(send)
        await app(scope, receive, send)

    return asgi
