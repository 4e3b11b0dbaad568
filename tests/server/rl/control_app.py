"""The app over a :class:`~.control_fakes.ControlledFleet`, served on a free port, with an API key and an admin key."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace
from typing import Any, AsyncIterator

import httpx

from megatron_serve.http_options import HTTPOptions
from megatron_serve.server import create_app

from ...helpers import until
from ..conftest import serving
from .control_fakes import ControlledFleet

API_KEY, ADMIN_KEY = "api-key", "admin-key"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@contextlib.asynccontextmanager
async def controlled(tokenizer: Any, options: HTTPOptions | None = None, **fleet: Any
                     ) -> AsyncIterator[SimpleNamespace]:
    """The served app, its fleet and an HTTP client (``fleet``: :class:`ControlledFleet`'s options; ``options``:
    the app's)."""
    backend = ControlledFleet(tokenizer, **fleet)
    app = create_app(backend, tokenizer, "tiny-llama", api_key=API_KEY, admin_key=ADMIN_KEY, vocab_size=512,
                     max_model_len=1024, status_interval=0.05, options=options)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield SimpleNamespace(fleet=backend, http=http)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


async def start_stream(http: httpx.AsyncClient, max_tokens: int, request_id: str | None = None
                       ) -> tuple[contextlib.AsyncExitStack, httpx.Response]:
    """A streamed completion, opened (its first chunk not read yet); close the returned stack when done."""
    stack = contextlib.AsyncExitStack()
    body: dict[str, Any] = {"model": "tiny-llama", "prompt": [3, 4, 5], "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if request_id is not None:
        body["request_id"] = request_id
    response = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body, headers=API))
    assert response.status_code == 200
    return stack, response


async def chunks(response: httpx.Response) -> list[dict]:
    """Every chunk of a streamed completion, until ``[DONE]``."""
    found = []
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            found.append(json.loads(line[len("data: "):]))
    return found


async def pause_aborts_a_stream(s: SimpleNamespace, path: str, after: int) -> None:
    """A 200-token stream under way (``after`` tokens generated) when ``path`` is posted (a pause that aborts, by
    one framework's route) ends with ``finish_reason`` ``abort`` and the tokens it had."""
    stack, response = await start_stream(s.http, 200)
    read = asyncio.create_task(chunks(response))
    await until(lambda: any(len(r.collector.tokens) >= after for r in s.fleet.requests.values()), 20,
                f"a stream's first {after} tokens")
    assert (await s.http.post(path, headers=ADMIN)).status_code == 200
    generated, reason = tokens_and_reason(await asyncio.wait_for(read, 20))
    assert reason == "abort" and after <= generated < 200
    await stack.aclose()


def tokens_and_reason(found: list[dict]) -> tuple[int, str | None]:
    """How many tokens a stream generated (its usage) and its finish reason."""
    reasons = [c["choices"][0]["finish_reason"] for c in found if c["choices"] and c["choices"][0]["finish_reason"]]
    return found[-1]["usage"]["completion_tokens"], (reasons[-1] if reasons else None)
