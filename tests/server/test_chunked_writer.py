"""Events of a stream written straight into uvicorn's connection (``server.chunked``): through the real server
the bytes on the wire are the same HTTP/1.1 chunks and events that uvicorn's own ``send`` wrote; every event
after the first goes through :class:`ChunkedWriter` (negative control: with it disabled, none does, and the
body is the same); a ``send`` that is not uvicorn's httptools one is left alone.
"""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_serve.server import chunked, create_app, streaming

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"


async def _stream(tokenizer, max_tokens: int) -> list[dict]:
    async with serving(create_app(FakeBackend(tokenizer), tokenizer, MODEL)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        answer = await http.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.headers["transfer-encoding"] == "chunked"
    lines = [line for line in answer.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


async def test_events_after_the_first_go_through_the_chunked_writer_and_match_sends(tokenizer, monkeypatch):
    written: list[bytes] = []
    write = chunked.ChunkedWriter.write

    async def counting(self, body: bytes) -> None:
        written.append(body)
        await write(self, body)

    monkeypatch.setattr(chunked.ChunkedWriter, "write", counting)
    direct = await _stream(tokenizer, 12)
    monkeypatch.setattr(streaming, "chunked_writer", lambda send: None)  # negative control: uvicorn's send only
    count = len(written)
    through_send = await _stream(tokenizer, 12)
    assert len(written) == count  # none went through the writer
    # every event went direct but the first (which waits for the status) and the last item's (the finish chunk),
    # which go with [DONE] and the end of the body, in one write
    assert count == len(direct) - 2 > 1
    strip = [{**c, "id": None, "created": None} for c in direct]
    assert strip == [{**c, "id": None, "created": None} for c in through_send]
    assert sum(len(c["choices"][0]["text"]) > 0 for c in direct) > 0


def test_a_send_other_than_uvicorn_httptools_gets_no_writer() -> None:
    async def send(message: dict) -> None:  # e.g. a test transport's, or another ASGI server's
        pass

    class Cycle:
        response_started, chunked_encoding, transport, scope = True, True, object(), {"method": "POST"}

        async def send(self, message: dict) -> None:
            pass

    assert chunked.chunked_writer(send) is None
    assert chunked.chunked_writer(Cycle().send) is None  # right shape, not uvicorn's
