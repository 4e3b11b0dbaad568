"""A served request leaves nothing for the garbage collector: its objects go by reference counting once it is done.

A request whose objects form a reference cycle waits for a collection; under an abort storm on a loaded host they
piled up (some 75 objects a request: its connection's transport and cycle, its scope, its submission and renderer)
and a full collection over them stopped the event loop for seconds (the hostile suite's ``/health`` probe saw 2 s).
Through the real server (uvicorn with httptools and the server's protocol), streams read to the end, streams whose
client leaves after the first event, whole answers and ``/health``; the collector then finds none of the server's
objects unreachable. The control: the same requests with the chunked body's strong reference to its cycle (as it
was) leave every request's objects behind.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter

import httpx
import pytest

from megatron_serve.server import chunked, create_app

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
STREAM = {"model": MODEL, "prompt": "x", "max_tokens": 16, "stream": True, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True,
        "ignore_eos": True, "n": 2}


async def _requests(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def leave_early(path: str, body: dict) -> None:
            async with http.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # the client leaves: the server aborts the stream

        for _ in range(2):
            whole = await asyncio.gather(*(http.post("/v1/completions", json=STREAM) for _ in range(4)),
                                         http.post("/v1/chat/completions", json=CHAT),
                                         http.post("/v1/completions", json={**STREAM, "stream": False}),
                                         http.get("/health"))
            assert all(r.status_code == 200 for r in whole), [r.text[:200] for r in whole]
            await asyncio.gather(*(leave_early("/v1/completions", STREAM) for _ in range(4)),
                                 leave_early("/v1/chat/completions", CHAT))


async def _server_garbage(tokenizer) -> Counter:
    """The server's objects that a collection finds unreachable after the requests (by type)."""
    backend = FakeBackend(tokenizer, token_delay=0.002)
    async with serving(create_app(backend, tokenizer, MODEL)) as url:
        await _requests(url)  # warm: what is made once (routes' caches, the loop's) is not counted
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await _requests(url)
            await asyncio.sleep(0.2)  # the aborted streams' tasks end
            gc.collect()
            found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                            if type(o).__module__.startswith(("megatron_serve.server", "uvicorn")))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    return found


async def test_requests_leave_no_reference_cycles(tokenizer):
    found = await _server_garbage(tokenizer)
    assert not found, found


async def test_control_a_strong_reference_to_the_cycle_leaves_every_request_behind(tokenizer, monkeypatch):
    made = chunked.ChunkedBody.__init__

    def strong(self, cycle) -> None:  # the reference as it was
        made(self, cycle)
        self._cycle = lambda: cycle

    monkeypatch.setattr(chunked.ChunkedBody, "__init__", strong)
    found = await _server_garbage(tokenizer)
    assert found["uvicorn.protocols.http.httptools_impl.RequestResponseCycle"] >= 20, found
    assert found["megatron_serve.server.chunked.ChunkedBody"] >= 20, found
