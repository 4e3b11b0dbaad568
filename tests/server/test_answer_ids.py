"""An answer's id: the client's request_id where it gave one (vLLM's rule), else 32 random hex digits, another for
every answer (the control routes abort a request by the id its client saw, so one client cannot guess another's)."""

from __future__ import annotations

import re

import httpx
import pytest

from megatron_serve.server import create_app

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"


async def test_answers_have_their_own_random_ids_unless_the_client_names_them(tokenizer):
    app = create_app(FakeBackend(tokenizer, max_sequence_length=1024), tokenizer, MODEL, vocab_size=512,
                     max_model_len=1024, status_interval=0.05)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        ids = [(await http.post("/v1/completions", json=body)).json()["id"] for _ in range(3)]
        chat_id = (await http.post("/v1/chat/completions", json=chat)).json()["id"]
        named = (await http.post("/v1/completions", json={**body, "request_id": "job-7"})).json()["id"]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 3
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat_id)
    assert named == "cmpl-job-7"
