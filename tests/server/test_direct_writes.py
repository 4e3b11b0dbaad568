"""A stream's pieces made and written by whoever delivers them (``Submission.deliver`` and ``streaming.stream_answer``):
through the real server (uvicorn with httptools) the pieces of running streams go straight into the connection
without waking the stream's task, and the answer on the wire is the same event for event as the one the stream's task
writes (negative control: with the bypass never ready, no piece takes it, and the events are equal). A connection
whose buffer is full takes the task's path and waits there while the other streams go on; once it drains, its answer
is whole. A piece whose chunk cannot be made ends the stream with an error event, as it would on the task's path.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve.server import chunked, create_app, streaming
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
    """Counts the pieces the bypass took."""
    counted: list[int] = []
    take = streaming._DirectWrites.take

    def counting(self, job, item) -> None:
        counted.append(len(item.new_tokens))
        take(self, job, item)

    monkeypatch.setattr(streaming._DirectWrites, "take", counting)
    return counted


async def _answers(tokenizer, body: dict, streams: int = 1) -> list[str]:
    backend = FakeBackend(tokenizer, token_delay=0.002)  # the stream's task waits between tokens: the bypass is open
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(streams)))
    assert all(answer.status_code == 200 for answer in answers)
    return [answer.text for answer in answers]


async def test_pieces_go_straight_into_the_connection_and_the_events_are_the_same(tokenizer, taken, monkeypatch):
    direct = await _answers(tokenizer, BODY, streams=3)
    bypassed = sum(taken)
    monkeypatch.setattr(chunked.ChunkedWriter, "ready", lambda self: False)  # negative control: the task's path
    through_task = await _answers(tokenizer, BODY)
    assert sum(taken) == bypassed  # none took the bypass
    assert bypassed > 3 * 2 * 24 / 2  # most of every stream's tokens went straight in (a few wait for the task)
    events = _events(through_task[0])
    assert all(_events(answer) == events for answer in direct)  # event for event, usage and log probs included
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    whole = await _answers(tokenizer, {**BODY, "stream": False, "stream_options": None})
    assert [c["text"] for c in json.loads(whole[0])["choices"]] == [texts[0], texts[1]]
    assert events[-1]["usage"]["completion_tokens"] == 48


async def test_a_full_connection_waits_on_the_tasks_path_while_other_streams_go_on(tokenizer, monkeypatch):
    writers: list = []
    divert = streaming.EventStreamResponse.stream_response

    async def keeping(self, send) -> None:  # the first stream's writer: its connection is the one made full
        original = self._divert

        def remember(writer) -> None:
            if writer is not None:
                writers.append(writer)
            original(writer)

        self._divert = remember if original is not None else None
        await divert(self, send)

    monkeypatch.setattr(streaming.EventStreamResponse, "stream_response", keeping)
    body = {**BODY, "n": 1, "max_tokens": 40}
    backend = FakeBackend(tokenizer, token_delay=0.002)
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json=body) as slow:
            chunks = slow.aiter_bytes()
            first = await chunks.__anext__()
            assert writers, "the stream never reached the bypass"
            flow = writers[0]._flow
            flow.pause_writing()  # as the transport says when the client does not read
            other = await http.post("/v1/completions", json=body)  # runs whole while the first waits
            assert other.status_code == 200 and _events(other.text)[-1]["usage"]["completion_tokens"] == 40
            assert not backend.running  # both generated everything: the first's pieces wait for its connection
            flow.resume_writing()
            rest = b"".join([chunk async for chunk in chunks])
    assert _events((first + rest).decode()) == _events(other.text)


async def test_a_piece_whose_chunk_fails_ends_the_stream_with_an_error_event(tokenizer, monkeypatch):
    def failing(self, job, item) -> None:
        raise APIError(500, "the chunk could not be made", code="internal_error")

    monkeypatch.setattr(streaming._DirectWrites, "take", failing)
    text = (await _answers(tokenizer, {**BODY, "n": 1}))[0]
    lines = [line for line in text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["message"] == "the chunk could not be made"
