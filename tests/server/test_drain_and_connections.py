"""A server that stops drains first, and connections are bounded, against a fake backend over real HTTP.

Drain: before, the first stop signal ended every request within 2 s whatever ``--drain-timeout``
said. Connections: 1,000 idle TCP connections were never closed (uvicorn's keep-alive deadline
starts after a first response), and past the open-file limit every failed ``accept()`` logged a
traceback (42,883 in 8 s at a 300-file limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from megatron_serve.server import connections
from megatron_serve.server.connections import BurstLog

from ..helpers import until
from .fakes import FakeBackend
from .test_app import MODEL, assert_error, make_app
from .test_intake import serving_with

pytestmark = pytest.mark.timeout(180)

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40}


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, max_sequence_length=1024, token_delay=0.05)  # 40 tokens: 2 s


async def test_a_stop_drains_admitted_requests_refuses_new_ones_and_answers_the_rest_at_the_deadline(tokenizer,
                                                                                                        backend):
    app = make_app(tokenizer, backend)
    url, stop, task = await serving_with(app, drain_timeout=30)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        streams = [asyncio.create_task(collect_stream(http, LONG)) for _ in range(2)]
        whole = [asyncio.create_task(http.post("/v1/completions", json=LONG)) for _ in range(2)]
        await until(lambda: len(backend.running) == 4, 10, "4 requests running")
        stop.set()
        await until(app.state.ctx.drain.draining.is_set, 10, "admission to stop")
        refused = await http.post("/v1/completions", json=LONG)
        ready = await http.get("/ready")
        health = await http.get("/health")
        answers = [await r for r in whole]
        events = [await s for s in streams]
    await asyncio.wait_for(task, 30)
    error = assert_error(refused, 503, None, "server_shutting_down")
    assert refused.headers["retry-after"] and "shutting down" in error["message"]
    assert ready.status_code == 503 and ready.json()["detail"] == "this server is shutting down (draining)"
    assert health.status_code == 200
    assert [a.status_code for a in answers] == [200, 200]  # they finished: 40 tokens each, not an error
    assert all(a.json()["choices"][0]["finish_reason"] == "length" for a in answers)
    for chunks in events:
        assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
    assert backend.aborted == []


async def test_what_is_still_running_at_the_drain_deadline_ends_with_an_error(tokenizer, backend):
    backend.token_delay = 0.5  # 40 tokens: 20 s, beyond the drain timeout
    url, stop, task = await serving_with(make_app(tokenizer, backend), drain_timeout=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        stream = asyncio.create_task(collect_stream(http, LONG))
        whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
        await until(lambda: len(backend.running) == 2, 10, "2 requests running")
        began = time.monotonic()
        stop.set()
        answer, chunks = await whole, await stream
        took = time.monotonic() - began
    await asyncio.wait_for(task, 30)
    assert_error(answer, 503, None, "server_shutting_down")
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["error"]["code"] == "server_shutting_down"
    assert 1.0 <= took < 10, took
    assert len(backend.aborted) == 2


async def collect_stream(http: httpx.AsyncClient, body: dict) -> list[str]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def connected(app, count: int, **options) -> AsyncIterator[tuple[str, list[Connection]]]:
    """``app`` served with ``serve_app``'s ``options`` and ``count`` TCP connections opened to it one after another
    (none has sent a byte); yields the URL and them, then closes them and stops the server."""
    url, stop, task = await serving_with(app, **options)
    host, port = url.removeprefix("http://").split(":")
    opened: list[Connection] = []
    try:
        for _ in range(count):
            opened.append(await asyncio.open_connection(host, int(port)))
        yield url, opened
    finally:
        for _, writer in opened:
            writer.close()
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_idle_connections_are_closed_after_the_keep_alive_timeout_even_before_a_first_byte(tokenizer, backend):
    async with connected(make_app(tokenizer, backend), 51, timeout_keep_alive=0.5) as (_, opened):
        *idle, (used_reader, used_writer) = opened
        used_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        began = time.monotonic()
        closed = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in idle)), 10)
        took = time.monotonic() - began
        answer = await asyncio.wait_for(used_reader.read(), 10)  # answered, then closed once idle
        assert closed == [b""] * 50 and 0.4 < took < 5, took
        assert answer.startswith(b"HTTP/1.1 200")


async def test_a_used_connection_is_kept_longer_than_one_that_sent_nothing(tokenizer, backend, monkeypatch):
    """Between two requests a connection may idle for --timeout-keep-alive (130 s by default: longer than clients
    and proxies keep idle connections, so that they close first and never send on one the server is closing);
    before its first request only the first-request deadline (5 s; shortened here)."""
    monkeypatch.setattr(connections, "FIRST_REQUEST_IDLE", 0.3)
    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 10)
        return head

    async with connected(make_app(tokenizer, backend), 21, timeout_keep_alive=3.0) as (_, opened):
        *idle, (used_reader, used_writer) = opened
        assert (await health(used_reader, used_writer)).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        closed = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in idle)), 10)
        assert closed == [b""] * 20 and time.monotonic() - began < 2.5
        # idle past the first-request deadline, within the keep-alive: still served
        assert (await health(used_reader, used_writer)).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert await asyncio.wait_for(used_reader.read(), 10) == b""  # then closed once idle for the keep-alive
        assert 2.5 < time.monotonic() - began < 6


async def test_connections_past_the_cap_get_a_fast_503_and_one_log_line(tokenizer, backend, caplog):
    caplog.set_level(logging.WARNING, "megatron_serve.server")
    app = make_app(tokenizer, backend)
    async with connected(app, 50, max_connections=20, timeout_keep_alive=30) as (url, opened):
        held, extra = opened[:20], opened[20:]
        began = time.monotonic()
        answers = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in extra)), 10)
        took = time.monotonic() - began
        assert all(a.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in a for a in answers), answers[0]
        assert json.loads(answers[0].partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        assert took < 5, took  # at once, not after the 30 s keep-alive the held ones get
        for _, writer in held[:5]:
            writer.close()
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=url) as http:  # room again
            assert (await http.get("/health")).status_code == 200
    refusals = [r for r in caplog.records if "at its limit of open connections" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]


def test_a_burst_is_one_line_when_it_starts_and_one_with_its_count_when_it_ends(caplog):
    caplog.set_level(logging.WARNING, "megatron_serve.server")
    log = BurstLog(quiet=0.05)
    loop = asyncio.new_event_loop()
    try:
        def burst() -> None:
            for _ in range(1000):
                log.exception_handler(loop, {"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
        loop.call_soon(burst)
        loop.run_until_complete(asyncio.sleep(0.3))
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("socket.accept() out of system resource: OSError errno 24 (more of the same")
    assert lines[1] == "socket.accept() out of system resource: OSError errno 24: 999 more in the burst that ended " \
                       "0.05s ago"
