"""The front door's rules on a request's shape: the body's content type, ``stop_token_ids``, and the admin key's
401 and 403.

Each was answered wrongly before: a JSON body sent as ``text/plain`` (what a browser may send to another site
without asking it first) was served, ``stop_token_ids`` had no count limit nor vocabulary check (an id past the
vocabulary reached the engine), and a missing admin key was a 403 like a wrong one.
"""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_serve.limits import RequestLimits

from .conftest import serving
from .fakes import FakeBackend
from .test_app import MODEL, assert_error, make_app

pytestmark = pytest.mark.timeout(180)

USER = [{"role": "user", "content": "hi"}]
ADMIN_KEY = "admin-key-of-this-test"
BODIES = [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
          ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 2}),
          ("/tokenize", {"model": MODEL, "prompt": "hi"}),
          ("/detokenize", {"model": MODEL, "tokens": [5, 6]})]


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, max_sequence_length=1024)


@pytest.mark.parametrize("path,body", BODIES, ids=[p for p, _ in BODIES])
async def test_a_body_not_declared_json_is_a_415(tokenizer, backend, path, body):
    data = json.dumps(body).encode()
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {} if content_type is None else {"content-type": content_type}
            error = assert_error(await http.post(path, content=data, headers=headers), 415,
                                 code="unsupported_media_type")
            assert "application/json" in error["message"]
            assert (content_type or "declares no content type") in error["message"]
        for content_type in ("application/json", "Application/JSON; charset=utf-8"):
            answer = await http.post(path, content=data, headers={"content-type": content_type})
            assert answer.status_code == 200, answer.text
    assert len(backend.submitted) == (2 if path.startswith("/v1/") else 0)  # the two declared JSON


async def test_an_admin_verb_without_a_body_needs_no_content_type(tokenizer, backend):
    app = make_app(tokenizer, backend, admin_key=ADMIN_KEY)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        answer = await http.post("/v1/admin/unpause", headers=headers)
        assert answer.status_code not in (400, 401, 403, 415), answer.text
        assert_error(await http.post("/v1/admin/pause", content=b'{"mode": "abort"}',
                                     headers={**headers, "content-type": "text/plain"}), 415)


async def test_a_missing_admin_key_is_401_and_a_wrong_one_403(tokenizer, backend):
    app = make_app(tokenizer, backend, admin_key=ADMIN_KEY, api_key="api-key-of-this-test")
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        missing = await http.get("/v1/admin/status")
        assert assert_error(missing, 401, code="admin_key_required") and missing.headers["www-authenticate"] == "Bearer"
        assert_error(await http.get("/v1/admin/status", headers={"Authorization": "Bearer nope"}), 403,
                     code="invalid_admin_key")
        assert_error(await http.get("/v1/admin/status", headers={"Authorization": "Bearer api-key-of-this-test"}),
                     403, code="invalid_admin_key")
        # the API key's routes answer 401 to both, as vLLM's and OpenAI's do
        assert_error(await http.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(await http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401,
                     code="invalid_api_key")
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        off = await http.get("/v1/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert_error(off, 403, code="admin_disabled")  # no admin key configured: no key opens it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_token_ids_are_bounded_and_in_the_vocabulary(tokenizer, backend, path):
    app = make_app(tokenizer, backend, limits=RequestLimits(max_stop_token_ids=4))
    base = {"model": MODEL, "max_tokens": 2, **({"prompt": "hi"} if path == "/v1/completions" else {"messages": USER})}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        error = assert_error(await http.post(path, json={**base, "stop_token_ids": [5, 6, 7, 8, 9]}), 400,
                             "stop_token_ids")
        assert "5 ids" in error["message"] and "at most 4" in error["message"]
        error = assert_error(await http.post(path, json={**base, "stop_token_ids": [5, 512]}), 400, "stop_token_ids",
                             "invalid_token_id")
        assert "512" in error["message"] and "[0, 512)" in error["message"]
        assert backend.submitted == []
        assert (await http.post(path, json={**base, "stop_token_ids": [5, 6, 7, 511]})).status_code == 200
    assert backend.submitted[0][1].stop_token_ids == [5, 6, 7, 511]


def test_the_default_stop_token_ids_limit():
    assert RequestLimits().max_stop_token_ids == 1024
    with pytest.raises(ValueError, match="--max-stop-token-ids"):
        RequestLimits(max_stop_token_ids=0)
