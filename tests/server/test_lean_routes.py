"""The generation routes' lean way in (``server/fast_routes.py``) answers exactly as the whole FastAPI stack does.

Each case is sent to two apps over the same fake backend, served by uvicorn: one as built (its two generation
routes answered without Starlette's router and FastAPI's request handling) and one with its lean routes taken
away (every request the whole way, as before). Status, headers and body must be equal (the response id and
``created`` aside where the server makes them), and the lean app must not have reached its router for them: a
negative control that the comparison is between the two ways.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from megatron_serve.http_options import CORS, HTTPOptions
from megatron_serve.limits import RequestLimits
from megatron_serve.server import create_app

from .conftest import metric, serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
USER = [{"role": "user", "content": "Hi"}]
KEY = "sk-test"


def make_app(tokenizer: Any, backend: FakeBackend, lean: bool, **kwargs: Any):
    app = create_app(backend, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05, **kwargs)
    if not lean:
        app.lean = {}
    return app


class RouterCalls:
    """Counts the requests that reached the generation routes through Starlette's router."""

    def __init__(self, app: Any) -> None:
        self.count = 0
        for route in app.routes:
            if getattr(route, "path", None) in ("/v1/completions", "/v1/chat/completions"):
                inner = route.app

                async def counted(scope, receive, send, inner=inner):
                    self.count += 1
                    await inner(scope, receive, send)

                route.app = counted


def normalized(response: httpx.Response) -> tuple[int, list[tuple[str, str]], str]:
    """What must be equal between the two ways: status, headers (without the date), body (ids and times made by
    the server replaced)."""
    headers = sorted((k, v) for k, v in response.headers.items() if k not in ("date", "content-length"))
    body = re.sub(r'"created":\s*\d+', '"created":0', response.text)
    body = re.sub(r'"(cmpl|chatcmpl)-[0-9a-f]{32}"', r'"\1-x"', body)
    return response.status_code, headers, body


CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": 5}}),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4, "logprobs": 2, "n": 2,
                                  "request_id": "r1"}}),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True,
                                  "stream_options": {"include_usage": True}}}),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": USER, "max_completion_tokens": 4}}),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": USER, "max_completion_tokens": 4, "stream": True},
                              "headers": {"X-Request-Id": "req-7"}}),
    ("/v1/completions", {"json": {"model": MODEL}}),  # missing prompt
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "Hi", "bogus": 1}}),  # unknown field
    ("/v1/completions", {"json": {"model": "other", "prompt": "Hi"}}),  # no such model
    ("/v1/completions", {"json": {"model": MODEL, "prompt": [70000]}}),  # outside the vocabulary
    ("/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("/v1/completions", {"content": b"", "headers": {"content-type": "application/json"}}),
    ("/v1/completions", {"content": b"x" * 5000, "headers": {"content-type": "application/json"}}),  # over the limit
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": USER},
                              "headers": {"X-Request-Id": "x" * 300}}),
]


async def answers(app: Any, requests: list[tuple[str, str, dict[str, Any]]]) -> tuple[list[httpx.Response], list[str]]:
    """The answers to ``requests``, and the HTTP requests counted by route and status after them."""
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        got = [await http.request(method, path, **options) for method, path, options in requests]
        counted = [line for line in (await http.get("/metrics")).text.splitlines()
                   if line.startswith("megatron_serve_http_requests_total{")]
    return got, counted


async def compare(tokenizer: Any, requests: list[tuple[str, str, dict[str, Any]]],
                  **app_options: Any) -> list[httpx.Response]:
    """The answers of both apps to ``requests``, asserted equal; the lean app's router saw none of them, the whole
    stack's router those past the body limit."""
    results, counts = [], []
    for lean in (True, False):
        app = make_app(tokenizer, FakeBackend(tokenizer), lean, **app_options)
        calls = RouterCalls(app)
        got, counted = await answers(app, requests)
        results.append(got)
        counts.append(counted)
        assert (calls.count == 0) if lean else (calls.count > 0)
    assert counts[0] == counts[1] and counts[0]
    lean_answers, full_answers = results
    for (method, path, _), mine, theirs in zip(requests, lean_answers, full_answers):
        assert normalized(mine) == normalized(theirs), (method, path)
    return lean_answers


async def test_lean_routes_answer_as_the_whole_stack(tokenizer):
    requests = [("POST", path, options) for path, options in CASES]
    requests += [("GET", "/v1/completions", {}), ("PUT", "/v1/chat/completions", {"json": {}})]  # 405, the full way
    got = await compare(tokenizer, requests, limits=RequestLimits(max_body_bytes=4096))
    statuses = [r.status_code for r in got]
    assert statuses == [200, 200, 200, 200, 200, 400, 400, 404, 400, 400, 400, 413, 400, 405, 405]
    assert got[2].headers["content-type"].startswith("text/event-stream") and got[2].text.endswith("data: [DONE]\n\n")


async def test_lean_routes_check_the_key_and_cors_as_the_whole_stack(tokenizer):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    origin = {"Origin": "https://app.example"}
    requests = [("POST", "/v1/completions", {"json": body}),  # no key
                ("POST", "/v1/completions", {"json": body, "headers": {"Authorization": "Bearer wrong"}}),
                ("POST", "/v1/completions", {"json": body, "headers": {"Authorization": f"Basic {KEY}"}}),
                ("POST", "/v1/completions", {"json": body, "headers": {"Authorization": f"bearer {KEY}", **origin}}),
                ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": USER, "stream": True},
                                                  "headers": {"Authorization": f"Bearer {KEY}", **origin}}),
                ("OPTIONS", "/v1/completions", {"headers": {**origin, "Access-Control-Request-Method": "POST"}})]
    options = HTTPOptions(cors=CORS(("https://app.example",)))
    got = await compare(tokenizer, requests, api_key=KEY, options=options)
    assert [r.status_code for r in got] == [401, 401, 401, 200, 200, 200]
    assert got[0].headers["www-authenticate"] == "Bearer"
    assert got[3].headers["access-control-allow-origin"] == "https://app.example"


async def test_lean_routes_admit_limit_and_count_as_the_whole_stack(tokenizer):
    for lean in (True, False):
        backend = FakeBackend(tokenizer)
        app = make_app(tokenizer, backend, lean, max_concurrent_requests=1)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            backend.gate.clear()  # the first request is held: the queue (1) is full
            held = asyncio.create_task(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}))
            while not backend.submitted:
                await asyncio.sleep(0.01)
            full = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert json.loads(full.text)["error"]["code"] == "queue_full"
            app.state.ctx.drain.draining.set()
            refused = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert refused.headers["retry-after"] == "5"
            assert app.state.ctx.drain.in_flight == 1  # the held one, admitted before the drain
            backend.gate.set()
            assert (await held).status_code == 200
            assert app.state.ctx.drain.in_flight == 0
            text = (await http.get("/metrics")).text
        series = "megatron_serve_http_requests_total"
        assert metric(text, series, 'code="200",route="/v1/completions"') == 1
        assert metric(text, series, 'code="429",route="/v1/completions"') == 1
        assert metric(text, series, 'code="503",route="unmatched"') == 1  # refused before any route ran


async def test_an_unexpected_error_is_a_logged_500_either_way(tokenizer, caplog):
    class Broken(type(tokenizer)):  # type: ignore[misc]
        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise ZeroDivisionError("tokenizer broke")

    broken = Broken.__new__(Broken)
    broken.__dict__.update(tokenizer.__dict__)
    requests = [("POST", "/v1/completions", {"json": {"model": MODEL, "prompt": "Hi"}})]
    results = []
    for lean in (True, False):
        caplog.clear()
        app = make_app(broken, FakeBackend(tokenizer), lean)
        results.append((await answers(app, requests))[0])
        assert "unexpected error answering POST /v1/completions" in caplog.text
    (mine,), (theirs,) = results
    assert normalized(mine) == normalized(theirs)
    assert mine.status_code == 500 and mine.json()["error"]["message"].startswith("internal error: ZeroDivisionError")
