"""Server-sent events, and answering a request only while its client is still there.

Two problems that both routes share:

* A streamed answer must still be able to fail with a proper status code (400, 429, 503) when
  the problem shows before the first token, so :func:`stream_answer` waits for the first
  event before sending headers; problems after that become an ``error`` event in the stream,
  which ``[DONE]`` ends either way. Its events have one producer (the answer's renderer, fed by
  its submission as items arrive) and one writer (:class:`EventWriter`).
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
import collections
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from .chunks import TextChunks, sse
from .chunked import ChunkedBody, chunked_body, offered
from .drain import Stopping
from .errors import APIError, shutting_down

logger = logging.getLogger("megatron_serve.server")

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
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
    """Whether the client of one request left, shared by the wait for the answer (:func:`cancel_on_disconnect`) and
    the stream that follows (:class:`EventStreamResponse`). The server's own protocol says so itself (its
    :class:`~.chunked.ChunkedBody`'s ``on_leave``); under another server, one task waits for ``http.disconnect``."""

    __slots__ = ("_watcher", "_body", "_cancel", "_open", "left")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._cancel: set[asyncio.Task[Any]] = set()  # tasks to cancel when the client leaves
        self.left = False  # the client left (and the tasks to cancel then were cancelled)
        self._open = True
        self._body = offered(scope)
        self._watcher: asyncio.Future[None] | None = None
        if self._body is None:
            self._watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
            self._watcher.add_done_callback(self._leave)
        elif self._body.left():  # already gone: on the next turn, as the watcher would find it
            asyncio.get_running_loop().call_soon(self._left)
        else:
            self._body.on_leave = self._left

    def _leave(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():
            self._left()

    def _left(self) -> None:
        if self._open:
            self.left = True
            for task in self._cancel:
                task.cancel()

    def cancel_on_leave(self, task: asyncio.Task[Any]) -> Callable[[], None]:
        """Cancel ``task`` when the client leaves, until the returned function is called."""
        self._cancel.add(task)
        return lambda: self._cancel.discard(task)

    def close(self) -> None:
        self._open = False
        self._cancel.clear()
        if self._watcher is not None:
            self._watcher.cancel()
        elif self._body.on_leave == self._left:
            self._body.on_leave = None


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]],
                               stopping: Stopping) -> T | Response:
    """Await ``work()`` in this task; if the client disconnects first, cancel it and return a 499 nobody will read;
    if the server stops first (``stopping``), cancel it and answer 503. An :class:`EventStreamResponse` that ``work``
    returns takes over the watch for the client leaving."""
    task = asyncio.current_task()
    assert task is not None
    departure = Departure(request.scope, request.receive)
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
    """The chunk producer of an answer: ``item`` makes the events of one arrived item, ``end`` those after the last
    (each as the bytes of its events, in order; empty for none). ``text_chunks``: what makes the events of a job's
    later pieces from their text alone (``client.streams.TextSink``), asked once its first piece went (``item``);
    None: every piece goes whole."""

    def item(self, job: Any, item: T) -> bytes: ...

    def text_chunks(self, job: Any) -> TextChunks | None: ...

    def end(self) -> bytes: ...


class Lane(Protocol):
    """What writes an answer's pieces straight into its connection while :class:`EventWriter` says it may: ``direct``
    is that transport, or None."""

    direct: Any


class EventWriter:
    """The one way a streamed answer's bytes reach its client, in order, whoever made them (the client's receive loop in
    its pass over a step, or a job's task).

    :meth:`write` puts a piece's events into the connection at once when it can (the response started, its
    :class:`~.chunked.ChunkedBody` takes them now, nothing written before waits); else they wait here, in order, for the
    response's task (:meth:`pour`), which writes them as the connection takes them. :meth:`finish` ends the answer
    (its last events go with the end of the body); :meth:`fail` ends it with an error: raised by :meth:`first`, for
    its status code, when nothing was made yet, else an ``error`` event and ``[DONE]``.

    An answer of several choices (``n`` > 1, or several prompts) :meth:`gather` s its pieces: every choice's piece of
    one step arrives in the same pass of the client's receive loop, and they go out as one chunk when that pass ends
    (a callback of the event loop's next turn) instead of a chunk, a ``send`` system call, per choice: the write is
    most of a streamed token's CPU in the HTTP server. One choice's answer writes each piece at once, as the extra
    turn would cost it more than it saves.

    A :class:`Lane` (a plain stream's sink, ``generation._TextTagged``) is told the connection's transport while a
    piece may go straight into it: the response is being poured through a :class:`~.chunked.ChunkedBody`, nothing
    waits, nothing is gathered and the answer has not ended; else None. It then writes its pieces there itself
    (:func:`~.chunked.write_chunk`), in the same order and on the same conditions as :meth:`write`, and a streamed
    token reads neither this writer, its queue nor the body: each is one more object to fetch from memory per token
    (what it saves: docs/benchmarks.md, issue 84). The writer tells its lanes whenever that changes, which is a few
    times per answer, and forgets them when it ends (no reference cycle left to the garbage collector).
    """

    __slots__ = ("_waiting", "_body", "_wake", "_gathered", "_gathering", "made", "last", "error", "_direct",
                 "_lanes")

    def __init__(self) -> None:
        self._waiting: collections.deque[bytes] = collections.deque()
        self._body: ChunkedBody | None = None  # once the response started with chunked encoding
        self._wake: asyncio.Future[None] | None = None
        self._gathering = False  # (see gather)
        self._gathered: list[bytes] | None = None  # pieces to write as one when this turn of the loop ends
        self.made = False  # some events were made (an error after that is an error event)
        self.last: bytes | None = None  # set when the answer ended: what goes with the end of the body
        self.error: APIError | None = None  # the answer failed before any event
        self._direct: Any = None  # the transport its lanes write into, or None (see the class docstring)
        self._lanes: list[Lane] = []

    @property
    def done(self) -> bool:
        return self.last is not None

    def gather(self) -> None:
        """Write the pieces made in one turn of the event loop as one chunk (see the class docstring)."""
        self._gathering = True
        self._tell(None)

    def write(self, data: bytes) -> None:
        """A piece's events, in order after everything written before."""
        if self.last is not None:
            return
        self.made = True
        body = self._body
        if body is not None and not self._gathering and not self._waiting and body.write_now(data):
            return  # one choice's piece, the connection free: written now (most pieces)
        gathered = self._gathered
        if gathered is not None:
            gathered.append(data)
            return
        if self._gathering and self._body is not None and not self._waiting:
            self._gathered = [data]
            asyncio.get_running_loop().call_soon(self._write_gathered)
            return
        self._put(data)

    def _put(self, data: bytes) -> None:
        body = self._body
        if body is not None and not self._waiting and body.write_now(data):
            return
        self._tell(None)  # until pour has written what waits
        self._waiting.append(data)
        self._signal()

    def _write_gathered(self) -> None:
        gathered, self._gathered = self._gathered, None
        if gathered and self.last is None:
            self._put(b"".join(gathered))

    def finish(self, last: bytes) -> None:
        """The answer's last events (after everything written before, with the end of the body)."""
        if self.last is None:
            self._forget_lanes()
            gathered, self._gathered = self._gathered, None
            if gathered:  # before the last events, with whatever waits
                self._waiting.append(b"".join(gathered))
            self.made = True
            self.last = last
            self._signal()

    def fail(self, error: APIError) -> None:
        """End the answer with ``error`` (see the class docstring)."""
        if self.last is not None:
            return
        if self.made:
            self.finish(sse(error.body()) + DONE)
        else:
            self.error, self.last = error, b""
            self._signal()

    def close(self) -> None:
        """Nothing more is written (the client left, or the response ended)."""
        if self.last is None:
            self.last = b""
        self._forget_lanes()
        self._waiting.clear()
        self._gathered = None
        self._body = None

    def add_lane(self, lane: Lane) -> None:
        """Tell ``lane`` the transport it may write into, now and whenever that changes, until the answer ends."""
        if self.last is None:
            self._lanes.append(lane)
            lane.direct = self._direct

    def _tell(self, transport: Any) -> None:
        if transport is not self._direct:
            self._direct = transport
            for lane in self._lanes:
                lane.direct = transport

    def _forget_lanes(self) -> None:
        self._tell(None)
        self._lanes = []

    def _signal(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _wait(self) -> None:
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    async def first(self) -> None:
        """Wait for the answer's first events (or its end); raises the error it failed with before any."""
        while not self._waiting and self.last is None:
            await self._wait()
        if self.error is not None:
            raise self.error

    async def pour(self, body: ChunkedBody | None, send: Send) -> bytes:
        """Write what waits and what comes, as the connection takes it (``body``; None: through ``send``), until the
        answer ends; returns its last events. Once this runs, pieces that find nothing waiting and room in the
        connection are written by whoever made them (:meth:`write`)."""
        self._body = body
        waiting = self._waiting
        while True:
            while waiting:
                # Everything that waits goes as one chunk: the pieces made before the response started (with a
                # backlog of steps, most often several of them) cost one write instead of one each
                count = len(waiting)
                data = waiting[0] if count == 1 else b"".join(waiting)
                if body is not None:
                    await body.write(data)
                else:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                for _ in range(min(count, len(waiting))):  # (close() empties it; pieces may have come meanwhile)
                    waiting.popleft()
            if self.last is not None:
                return self.last
            if body is not None and not self._gathering:
                self._tell(body.transport)  # nothing waits: the next pieces may go straight in (see the class)
            await self._wait()


class StreamSource(Protocol):
    """The work a streamed answer streams (``generation.Submission`` is one), named here so that the module that makes
    the events writes them through this one and this one knows nothing else of it: ``start_stream`` starts it, each
    item becoming events through ``render``, written to ``writer``; ``close`` aborts what is unfinished."""

    def start_stream(self, render: Renderer[Any], writer: EventWriter) -> None: ...

    def close(self) -> None: ...


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose events an :class:`EventWriter` holds (see :func:`stream_answer`).

    The status line and the end of the body go through ``send`` (and so through the app's middleware, which
    records the status and whether the answer started); the events between them go into the connection through
    the protocol's :class:`~.chunked.ChunkedBody` when it offers one (through ``send`` otherwise).
    """

    media_type = "text/event-stream"
    _headers: tuple[tuple[bytes, bytes], ...] | None = None  # every stream's: what init_headers makes, made once

    def __init__(self, writer: EventWriter, submission: StreamSource, answer_id: str) -> None:
        self.status_code = 200
        self.background = None
        if EventStreamResponse._headers is None:
            self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            EventStreamResponse._headers = tuple(self.raw_headers)
        self.raw_headers = list(EventStreamResponse._headers)
        self._writer = writer
        self._submission = submission
        self._answer_id = answer_id
        self.departure: Departure | None = None  # the watch for the client leaving, when the wait had one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream in this task while a :class:`Departure` waits for the client to leave (and then cancels it): a
        client that leaves cancels the stream (which aborts its engine requests) and the call returns normally."""
        task = asyncio.current_task()
        assert task is not None
        departure = self.departure or Departure(scope, receive)
        forget = departure.cancel_on_leave(task)
        ended = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = await self._writer.pour(chunked_body(scope), send)
            ended = True
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not departure.left or task.uncancel() > 0:
                raise
            # the departure's own cancellation, not the caller's: answered, as Starlette does
        finally:
            forget()
            departure.close()
            self._writer.close()
            self._submission.close()  # aborts what is unfinished (a client that left)
            if not ended:
                logger.debug("the client of %s left its stream: its engine requests are aborted", self._answer_id)


async def stream_answer(submission: StreamSource, render: Renderer[Any], answer_id: str) -> EventStreamResponse:
    """The streamed answer of ``submission``, its events made by ``render`` as its items arrive and written by one
    :class:`EventWriter`: an :class:`EventStreamResponse` once the first events exist, so that a problem before them
    is still answered with its status code (400, 429, 503); after them it becomes an ``error`` event, and
    ``data: [DONE]`` ends the stream either way, as OpenAI clients expect."""
    writer = EventWriter()
    try:
        submission.start_stream(render, writer)
        await writer.first()
    except BaseException:
        writer.close()
        submission.close()
        raise
    return EventStreamResponse(writer, submission, answer_id)
