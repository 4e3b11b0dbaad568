"""A streamed answer's one writer (``streaming.EventWriter``) over the connection's ``ChunkedBody`` (``server.chunked``).

Through the real server (uvicorn with httptools and the server's protocol, which offers the body writer as an ASGI
extension), a running stream's pieces go straight into the connection by whoever delivers them, and the answer on
the wire is the same event for event as the one written through ASGI ``send`` (negative control: without the
extension, none goes straight in, and the events are equal). A connection whose buffer is full keeps its pieces in
the writer while the other streams go on; once it drains, its answer is whole. A piece whose events cannot be made
ends the stream with an error event. A scope without the extension, or a response that is not chunked, gets none.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve.server import chunked, completions, create_app, streaming
from megatron_serve.server.errors import APIError

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
#: Two choices, log probs with alternatives, usage on every chunk and at the end: every part of a chunk.
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 24, "stream": True, "ignore_eos": True, "n": 2, "logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def _events(text: str) -> list[dict]:
    lines = [line for line in text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [{**event, "id": None, "created": None} for event in (json.loads(line[len("data: "):])
                                                                  for line in lines[:-1])]


@pytest.fixture
def taken(monkeypatch) -> list[int]:
    """Counts the chunks written straight into the connection by whoever made them."""
    counted: list[int] = []
    write_now = chunked.ChunkedBody.write_now

    def counting(self, body: bytes) -> bool:
        written = write_now(self, body)
        if written:
            counted.append(len(body))
        return written

    monkeypatch.setattr(chunked.ChunkedBody, "write_now", counting)
    return counted


async def _answers(tokenizer, body: dict, streams: int = 1) -> list[str]:
    backend = FakeBackend(tokenizer, token_delay=0.002)
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(streams)))
    assert all(answer.status_code == 200 for answer in answers)
    return [answer.text for answer in answers]


async def test_pieces_go_straight_into_the_connection_and_the_events_are_the_same(tokenizer, taken, monkeypatch):
    direct = await _answers(tokenizer, BODY, streams=3)
    straight = len(taken)
    monkeypatch.setattr(streaming, "chunked_body", lambda scope: None)  # negative control: every event through send
    through_send = await _answers(tokenizer, BODY)
    assert len(taken) == straight  # none went straight in
    assert straight > 3 * 24 / 2  # most of every stream's pieces went straight in
    events = _events(through_send[0])
    assert all(_events(answer) == events for answer in direct)  # event for event, usage and log probs included
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    whole = await _answers(tokenizer, {**BODY, "stream": False, "stream_options": None})
    assert [c["text"] for c in json.loads(whole[0])["choices"]] == [texts[0], texts[1]]
    assert events[-1]["usage"]["completion_tokens"] == 48


class Full:
    """A connection's transport whose buffer holds bytes (``waiting``) the client has not read."""

    def __init__(self, transport, waiting: int = 1 << 20) -> None:
        self.transport = transport
        self.waiting = waiting

    def get_write_buffer_size(self) -> int:
        return self.waiting

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


async def test_a_full_connection_keeps_its_pieces_while_other_streams_go_on(tokenizer, monkeypatch):
    bodies: list = []
    offered = streaming.chunked_body

    def keeping(scope):  # the first stream's body writer: its connection is the one made full (its transport wrapped
        body = offered(scope)  # before the answer is poured, since a plain stream's sink then holds the transport)
        if body is not None and not bodies:
            body._transport = Full(body._transport, waiting=0)
        bodies.append(body)
        return body

    monkeypatch.setattr(streaming, "chunked_body", keeping)
    body = {**BODY, "n": 1, "max_tokens": 40}
    backend = FakeBackend(tokenizer, token_delay=0.002)
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json=body) as slow:
            chunks = slow.aiter_bytes()
            first = await chunks.__anext__()
            assert bodies and bodies[0] is not None, "the stream got no body writer"
            full = bodies[0]._transport
            full.waiting = 1 << 20  # what the transport and its protocol say when the client does not read:
            flow = bodies[0]._flow  # bytes wait in its buffer, past the mark where writing pauses
            flow.pause_writing()
            other = await http.post("/v1/completions", json=body)  # runs whole while the first waits
            assert other.status_code == 200 and _events(other.text)[-1]["usage"]["completion_tokens"] == 40
            assert not backend.running  # both generated everything: the first's pieces wait for its connection
            full.waiting = 0
            flow.resume_writing()
            rest = b"".join([chunk async for chunk in chunks])
    assert _events((first + rest).decode()) == _events(other.text)


async def test_pieces_made_before_the_response_started_go_out_as_one_chunk(tokenizer, monkeypatch):
    """Pieces that wait for the response's task (made before it started: a backlog of steps, here a backend that makes
    every piece at once) go into the connection as one chunk, not a write each; the events are the same. Control:
    through ``send``, the same events."""
    writes: list[bytes] = []
    write = chunked.ChunkedBody.write

    async def counting(self, body: bytes) -> None:
        writes.append(body)
        await write(self, body)

    monkeypatch.setattr(chunked.ChunkedBody, "write", counting)
    body = {**BODY, "n": 1, "logprobs": None, "stream_options": None}
    backend = FakeBackend(tokenizer)  # no token delay: its task makes every piece in one go
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        answer = await http.post("/v1/completions", json=body)
    assert answer.status_code == 200
    events = _events(answer.text)
    assert len(events) > 10 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(writes) == 1 and writes[0].count(b"data: ") == len(events) - 1  # every piece's event, one write (the
    # last chunk and [DONE] go with the end of the body)
    monkeypatch.setattr(streaming, "chunked_body", lambda scope: None)
    assert events == _events((await _answers(tokenizer, body))[0])


async def test_a_piece_whose_events_fail_ends_the_stream_with_an_error_event(tokenizer, monkeypatch):
    made = completions._CompletionEvents.item
    calls = []

    def failing(self, job, item):
        calls.append(1)
        if len(calls) == 3:
            raise APIError(500, "the chunk could not be made", code="internal_error")
        return made(self, job, item)

    monkeypatch.setattr(completions._CompletionEvents, "item", failing)
    text = (await _answers(tokenizer, {**BODY, "n": 1}))[0]
    lines = [line for line in text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["message"] == "the chunk could not be made"
    assert len(lines) == 4  # two pieces' events, the error, [DONE]: nothing after the error


def test_a_scope_without_the_extension_or_a_response_not_chunked_gets_no_body_writer() -> None:
    assert chunked.chunked_body({"type": "http"}) is None  # another server's scope (or a test transport's)

    class Cycle:
        response_started, chunked_encoding, transport, flow, scope = True, False, object(), object(), {"method": "POST"}

    scope: dict = {"type": "http"}
    cycle = Cycle()  # the protocol holds its cycle while the request is served; the scope's writer does not
    chunked.offer(scope, cycle)
    assert chunked.chunked_body(scope) is None  # a response with a content length
    Cycle.chunked_encoding = True
    assert isinstance(chunked.chunked_body(scope), chunked.ChunkedBody)  # the control: a chunked one gets it
    del cycle
    assert chunked.chunked_body(scope) is None  # its cycle is gone (the request is done): nothing to write to


class _Connection:
    """A response's ``ChunkedBody`` as the writer sees it: takes every chunk at once and keeps it (the test's double of
    the connection; the real one is a socket's transport)."""

    transport = None  # no transport for a lane to write into: every piece goes through write_now or write

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write_now(self, body: bytes) -> bool:
        self.chunks.append(body)
        return True

    async def write(self, body: bytes) -> None:
        self.chunks.append(body)


async def _started(writer: streaming.EventWriter, connection: _Connection) -> asyncio.Task:
    pouring = asyncio.ensure_future(writer.pour(connection, None))  # the response's task: the body is the writer's
    await asyncio.sleep(0)
    return pouring


async def test_choices_of_one_pass_go_out_as_one_chunk_and_before_the_end():
    """An answer of several choices (``gather``) writes the pieces one pass of the receive loop made as one chunk,
    when the pass ends; the answer's end follows what was gathered. Control: one choice's pieces go at once."""
    connection = _Connection()
    writer = streaming.EventWriter()
    writer.gather()
    pouring = await _started(writer, connection)
    writer.write(b"data: choice 0\n\n")
    writer.write(b"data: choice 1\n\n")
    assert connection.chunks == []  # not yet: the pass goes on
    await asyncio.sleep(0)
    assert connection.chunks == [b"data: choice 0\n\ndata: choice 1\n\n"]
    writer.write(b"data: choice 0 again\n\n")
    writer.finish(b"data: [DONE]\n\n")
    assert await pouring == b"data: [DONE]\n\n"
    assert connection.chunks[1:] == [b"data: choice 0 again\n\n"]  # written by the response's task, before the end

    single = _Connection()
    writer = streaming.EventWriter()
    pouring = await _started(writer, single)
    writer.write(b"data: a\n\n")
    writer.write(b"data: b\n\n")
    assert single.chunks == [b"data: a\n\n", b"data: b\n\n"]  # at once, a chunk each
    writer.finish(b"")
    await pouring


class _Transport:
    """A connection's transport as the body writer sees it: what was written, and bytes its buffer holds."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.buffered = 0

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.data.append(data)


class _Body:
    """A ``ChunkedBody`` over :class:`_Transport` (the real one needs uvicorn's request-response cycle)."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport

    def write_now(self, body: bytes) -> bool:
        return chunked.write_chunk(self.transport, body)

    async def write(self, body: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class _Lane:
    direct = None


async def test_a_lane_holds_the_transport_only_while_nothing_waits_and_until_the_end():
    """A plain stream's sink (a lane) is given the connection's transport once the answer is poured and nothing waits;
    a piece that finds the connection's buffer full waits in the writer, and the lane loses the transport until the
    writer wrote it; the answer's end takes it back for good. Control: an answer that gathers never gives it."""
    transport = _Transport()
    writer = streaming.EventWriter()
    lane = _Lane()
    writer.write(b"data: first\n\n")  # before the response started: it waits
    writer.add_lane(lane)
    assert lane.direct is None
    pouring = asyncio.ensure_future(writer.pour(_Body(transport), None))
    await asyncio.sleep(0)
    assert lane.direct is transport and transport.data == [b"d\r\ndata: first\n\n\r\n"]
    transport.buffered = 100  # the client does not read: the next piece waits, and so must the lane's
    writer.write(b"data: second\n\n")
    assert lane.direct is None
    transport.buffered = 0
    await asyncio.sleep(0)  # the response's task writes what waits, then gives the transport back
    assert transport.data[1:] == [b"e\r\ndata: second\n\n\r\n"] and lane.direct is transport
    writer.finish(b"data: [DONE]\n\n")
    assert lane.direct is None
    assert await pouring == b"data: [DONE]\n\n"
    writer.add_lane(lane)  # too late: the answer ended
    assert lane.direct is None

    gathering, other = streaming.EventWriter(), _Lane()
    gathering.gather()
    gathering.write(b"data: a\n\n")
    gathering.add_lane(other)
    pouring = asyncio.ensure_future(gathering.pour(_Body(_Transport()), None))
    await asyncio.sleep(0)
    assert other.direct is None
    gathering.finish(b"")
    await pouring
