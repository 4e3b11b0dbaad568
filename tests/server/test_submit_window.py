"""One HTTP request of many engine requests (prompts x ``n``) reaches the fleet as a stream of work: at most a window
of them at once, the next as one finishes, whole answers and streams alike (issue 86: 160,000 engine requests sent at
once filled the coordinator's queue in one go). The control is the same request with a window above its size: all of
them at once. Over the fake backend (no model), which counts how many of its requests live at once."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve.server import create_app, generation

from ..helpers import until
from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

WINDOW = 4
CHOICES = 10


class CountingBackend(FakeBackend):
    """Its requests alive at once: the most (``most``), and every id it was asked to abort."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, token_delay=0.005)
        self.live = 0
        self.most = 0
        self.ids: list[str] = []

    async def _generate(self, request_id, prompt, params):
        self.ids.append(request_id)
        self.live += 1
        self.most = max(self.most, self.live)
        try:
            async for item in super()._generate(request_id, prompt, params):
                yield item
        finally:
            self.live -= 1


def _app(tokenizer, backend):
    return create_app(backend, tokenizer, "tiny-llama", vocab_size=512, max_model_len=1024)


def _body(**extra) -> dict:
    return {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 6, "temperature": 0, "n": CHOICES, **extra}


@pytest.mark.parametrize("window,most", [(WINDOW, WINDOW), (1024, CHOICES)])  # the second: the control
async def test_a_request_s_engine_requests_go_a_window_at_a_time(tokenizer, monkeypatch, window, most):
    monkeypatch.setattr(generation, "SUBMIT_WINDOW", window)
    backend = CountingBackend(tokenizer)
    async with serving(_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        whole = await http.post("/v1/completions", json=_body())
        assert whole.status_code == 200, whole.text
        assert sorted(c["index"] for c in whole.json()["choices"]) == list(range(CHOICES))
        assert all(c["finish_reason"] == "length" for c in whole.json()["choices"])
        assert backend.most == most and len(backend.ids) == CHOICES
        backend.most = 0
        finished = set()
        async with http.stream("POST", "/v1/completions", json=_body(stream=True)) as streamed:
            async for line in streamed.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            finished.add(choice["index"])
        assert finished == set(range(CHOICES))
        assert backend.most == most and len(backend.ids) == 2 * CHOICES


async def test_a_request_given_up_aborts_only_what_reached_the_fleet(tokenizer, monkeypatch):
    monkeypatch.setattr(generation, "SUBMIT_WINDOW", WINDOW)
    backend = CountingBackend(tokenizer)
    backend.gate.clear()  # a paused fleet: the first window waits
    async with serving(_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        asked = asyncio.ensure_future(http.post("/v1/completions", json=_body(stream=True)))
        await until(lambda: len(backend.ids) == WINDOW, 30, "the first window")
        asked.cancel()  # the client leaves
        await until(lambda: len(backend.aborted) == WINDOW, 30, "the window's aborts")
        assert sorted(backend.aborted) == sorted(backend.ids)  # the others never reached the fleet
        assert len(backend.ids) == WINDOW


async def test_abort_requests_ends_the_jobs_not_sent_yet_too(tokenizer, monkeypatch):
    """vLLM's ``/abort_requests`` cuts a request of ten choices while four run: all ten end with ``finish_reason``
    ``abort``, the six never sent with nothing generated, and the route counts ten."""
    from .rl.control_app import ADMIN, API, controlled  # noqa: PLC0415

    monkeypatch.setattr(generation, "SUBMIT_WINDOW", WINDOW)
    async with controlled(tokenizer, tick=0.02) as s:
        body = {"model": "tiny-llama", "prompt": [3, 4, 5], "max_tokens": 200, "n": CHOICES, "stream": True,
                "request_id": "cut-me"}
        async with s.http.stream("POST", "/v1/completions", json=body, headers=API) as streamed:
            assert streamed.status_code == 200
            await until(lambda: len(s.fleet.requests) == WINDOW, 30, "the first window to run")
            answer = await s.http.post("/abort_requests", json={"request_ids": ["cut-me"]}, headers=ADMIN)
            assert answer.json() == {"status": "aborted", "aborted": CHOICES}
            reasons = {}
            async for line in streamed.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            reasons[choice["index"]] = choice["finish_reason"]
        assert reasons == dict.fromkeys(range(CHOICES), "abort")
        assert len(s.fleet.aborted) == WINDOW  # the other six never reached the fleet: nothing to abort there
