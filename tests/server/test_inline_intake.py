"""Which requests the worker threads parse and tokenize (``intake.INLINE_BODY_BYTES``): a small completion without an
output constraint is handled on the event loop (no thread-pool hop), while a big body, a chat and a constrained
completion still go to the workers; the answers are the same either way."""

from __future__ import annotations

import httpx
import pytest

from megatron_serve.server import intake

from .conftest import serving
from .fakes import FakeBackend
from .test_app import MODEL, make_app

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, max_sequence_length=1024)


@pytest.fixture
def hops(monkeypatch) -> list[str]:
    """The names of the jobs given to the worker threads."""
    seen: list[str] = []
    run = intake.Workers.run

    async def counting(self, fn, *args):
        seen.append(getattr(fn, "__name__", type(fn).__name__))
        return await run(self, fn, *args)

    monkeypatch.setattr(intake.Workers, "run", counting)
    return seen


async def _post(tokenizer, backend, path: str, body: dict) -> dict:
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        answer = await http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_a_small_unconstrained_completion_takes_no_worker_thread(tokenizer, backend, hops):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    small = await _post(tokenizer, backend, "/v1/completions", body)
    assert hops == []
    big = await _post(tokenizer, backend, "/v1/completions", {**body, "user": "u" * intake.INLINE_BODY_BYTES})
    assert hops == ["_parse", "CompletionHandler"]  # negative control: a body over the size goes to the workers
    assert big["choices"][0]["text"] == small["choices"][0]["text"]


async def test_chats_and_constrained_completions_still_go_to_the_workers(tokenizer, backend, hops):
    await _post(tokenizer, backend, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert hops == ["ChatHandler"]  # parsed here (small), rendered on a worker
    hops.clear()
    await _post(tokenizer, backend, "/v1/completions",
                {"model": MODEL, "prompt": "hi", "max_tokens": 2, "guided_choice": ["yes", "no"]})
    assert hops == ["CompletionHandler"]  # its grammar is checked on a worker
