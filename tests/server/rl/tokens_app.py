"""What the tokens-in, tokens-out tests share: the app over ``FakeBackend`` (answer shapes and errors, no model) and
the events of a streamed answer."""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator

import httpx

from megatron_serve.server import create_app
from megatron_serve.tokenizer import Tokenizer

from ..conftest import serving
from ..fakes import FakeBackend

MODEL = "tiny-llama"


@contextlib.asynccontextmanager
async def fake_http(tokenizer: Tokenizer, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the app over a ``FakeBackend`` (context of 64 tokens), served on 127.0.0.1."""
    app = create_app(FakeBackend(tokenizer), tokenizer, MODEL, vocab_size=512, max_model_len=1024,
                     status_interval=0.05, **options)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield http


def events(text: str) -> list[Any]:
    """The JSON data of every server-sent event before ``[DONE]``, which must end the stream."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", text[-300:]
    return [json.loads(d) for d in data[:-1]]


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a 400."""
    assert response.status_code == 400, response.text
    return response.json()["error"]
