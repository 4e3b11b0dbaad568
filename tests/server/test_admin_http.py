"""The admin API (``/v1/admin/*``): the fleet's lifecycle over real HTTP, its keys, its strict bodies.

A real ``megatron-serve run`` (coordinator, one engine process, HTTP server) with an API key and an
admin key serves the module; the tests run in file order. The admin routes of a server without an
admin key, and the OpenAPI document, are checked against a fake backend (no processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from megatron_serve.server import create_app

from .conftest import admin_run, serving
from .fakes import FakeBackend

pytestmark = [pytest.mark.timeout(300)]

API_KEY, ADMIN_KEY = "inference-key", "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
VERBS = ("pause", "unpause", "suspend", "resume", "refit")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    env = {**os.environ, "MEGATRON_SERVE_API_KEY": API_KEY, "MEGATRON_SERVE_ADMIN_KEY": "not-this-one"}
    with admin_run(tiny_model, tmp_path_factory.mktemp("admin-run"), ADMIN_KEY, env=env) as url:
        yield SimpleNamespace(url=url, model=Path(tiny_model).name, path=tiny_model)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def admin(http: httpx.Client, verb: str, body: object = None, headers: dict | None = None) -> httpx.Response:
    if verb == "status":
        return http.get("/v1/admin/status", headers=ADMIN if headers is None else headers)
    content = b"" if body is None else json.dumps(body).encode()
    return http.post(f"/v1/admin/{verb}", content=content, headers={"Content-Type": "application/json",
                                                                     **(ADMIN if headers is None else headers)})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_only_the_admin_key_opens_the_admin_routes_and_it_opens_nothing_else(stack, http):
    for verb in (*VERBS, "status"):
        missing = admin(http, verb, headers={})  # no credential: 401; a wrong one: 403
        assert error_of(missing, 401)["code"] == "admin_key_required"
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        inference = error_of(admin(http, verb, headers={"Authorization": f"Bearer {API_KEY}"}), 403)
        assert inference["code"] == "invalid_admin_key" and "API key does not open" in inference["message"]
        assert error_of(admin(http, verb, headers={"Authorization": "Bearer not-this-one"}), 403)["code"] \
            == "invalid_admin_key"  # the file wins over the environment
    assert error_of(http.get("/v1/models", headers=ADMIN), 401)["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    status = admin(http, "status")
    assert status.status_code == 200 and status.json()["state"] == "RUNNING" and len(status.json()["engines"]) == 1


def test_bodies_are_strict_and_bad_values_name_their_field(http):
    cases = [
        ("pause", {"mode": "later"}, "mode"),
        ("pause", {"mode": "keep", "drain_timeout": 3}, "drain_timeout"),
        ("pause", {"mode": "wait", "drain_timeout": -1}, "drain_timeout"),
        ("pause", {"mode": "abort", "force": True}, "force"),
        ("unpause", {"now": True}, "now"),
        ("suspend", {"level": 3}, "level"),
        ("suspend", {"level": "1"}, "level"),
        ("suspend", {"level": 1, "keep_kv": "yes"}, "keep_kv"),
        ("refit", {}, "source"),
        ("refit", {"source": "/x", "epoch": -1}, "epoch"),
    ]
    for verb, body, param in cases:
        assert error_of(admin(http, verb, body), 400)["param"] == param, (verb, body)
    not_json = http.post("/v1/admin/pause", content=b"{mode", headers={"Content-Type": "application/json", **ADMIN})
    assert error_of(not_json, 400)["code"] == "invalid_json"
    as_text = http.post("/v1/admin/pause", content=b'{"mode": "abort"}',
                        headers={"Content-Type": "text/plain", **ADMIN})
    assert error_of(as_text, 415)["code"] == "unsupported_media_type"
    assert admin(http, "status").json()["state"] == "RUNNING"  # nothing was done


def test_pause_in_abort_mode_ends_a_running_completion_with_its_tokens_so_far(stack, http):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    answers: dict[str, object] = {}

    def complete() -> None:
        answers["whole"] = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=900,
                                                     temperature=0.0, extra_body={"ignore_eos": True})

    whole = threading.Thread(target=complete)
    streamed = {"chunks": [], "finish": None}
    body = {"model": stack.model, "prompt": "In a galaxy far away", "max_tokens": 900, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    # The whole completion goes to the engine first: the engine admits in arrival order and reports its
    # steps in order, so once the stream has its first text, the coordinator holds a token of both.
    whole.start()
    deadline = time.monotonic() + 60
    while admin(http, "status").json()["in_flight"] < 1:
        assert time.monotonic() < deadline, "the whole completion never reached the engine"
        time.sleep(0.05)
    with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as stream:
        lines = stream.iter_lines()
        for line in lines:  # the first piece of text: both requests run
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                streamed["chunks"].append(json.loads(line[6:])["choices"][0]["text"])
                break
        ack = admin(http, "pause", {"mode": "abort"})
        assert ack.status_code == 200, ack.text
        assert ack.json()["state"] == "PAUSED" and ack.json()["detail"]["mode"] == "abort"
        assert ack.json()["detail"]["aborted"] == 2
        for line in lines:
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                streamed["chunks"].append(choice["text"])
                streamed["finish"] = choice["finish_reason"] or streamed["finish"]
    whole.join(60)
    assert streamed["finish"] == "abort" and "".join(streamed["chunks"])
    result = answers["whole"]
    assert result.choices[0].finish_reason == "abort" and 0 < result.usage.completion_tokens < 900
    status = admin(http, "status").json()
    assert (status["state"], status["in_flight"], status["queued"], status["aborted"]) == ("PAUSED", 0, 0, 2)
    assert admin(http, "unpause").json()["state"] == "RUNNING"


def test_each_verb_answers_after_the_acknowledgement_and_the_table_refuses_with_409(stack, http):
    assert admin(http, "resume").json()["detail"]["noop"] is True  # memory is resident: a no-op
    refused = error_of(admin(http, "refit", {"source": stack.path}), 409)
    assert refused["code"] == "illegal_transition" and "PAUSE first" in refused["message"]
    suspended = admin(http, "suspend", {"level": 1}).json()
    assert suspended["state"] == "SUSPENDED" and suspended["detail"]["released_bytes"] > 0
    refused = error_of(admin(http, "unpause"), 409)
    assert refused["code"] == "illegal_transition" and "RESUME first" in refused["message"]
    assert admin(http, "resume").json()["state"] == "PAUSED"
    refit = admin(http, "refit", {"source": stack.path, "epoch": 5})
    assert refit.status_code == 200 and refit.json()["detail"]["epoch"] == 5, refit.text
    wrong = error_of(admin(http, "refit", {"source": "/no/such/model"}), 409)
    assert wrong["code"] == "refit_failed"
    waited = admin(http, "pause", {"mode": "wait", "drain_timeout": 1}).json()
    assert waited["detail"]["noop"] and waited["detail"]["mode"] == "wait"
    assert admin(http, "unpause").json()["state"] == "RUNNING"
    assert http.get("/ready").json()["state"] == "RUNNING"
    status = admin(http, "status").json()
    assert status["epoch"] == 5 and status["refits"] == 1


# --------------------------------------------------------------------------- without an admin key, no processes

async def test_without_an_admin_key_the_admin_api_is_off_and_documented(tokenizer):
    app = create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", api_key="k", status_interval=0.05)
    async with serving(app) as url, httpx.AsyncClient(base_url=url) as client:
        for headers in ({}, {"Authorization": "Bearer k"}):
            answer = await client.post("/v1/admin/pause", json={"mode": "abort"}, headers=headers)
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_disabled"
        assert (await client.get("/v1/admin/status")).status_code == 403
        doc = (await client.get("/openapi.json")).json()
    for verb in VERBS:
        operation = doc["paths"][f"/v1/admin/{verb}"]["post"]
        assert {"200", "403", "409"} <= set(operation["responses"]) and operation["tags"] == ["admin"]
    assert doc["components"]["schemas"]["PauseRequest"]["properties"]["mode"]["enum"] == ["keep", "wait", "abort"]
    assert doc["paths"]["/v1/admin/refit"]["post"]["requestBody"]["required"] is True
    assert "/v1/admin/status" in doc["paths"] and operation["security"] == [{"AdminKey": []}]
    with pytest.raises(ValueError, match="admin key must differ from the API key"):
        create_app(FakeBackend(tokenizer), tokenizer, "tiny-llama", api_key="same", admin_key="same")


def test_the_commands_refuse_an_admin_key_equal_to_the_api_key(tiny_model, tmp_path):
    key_file = tmp_path / "admin-key"
    key_file.write_text("same\n")
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "server", "--model", tiny_model,
                           "--coordinator", "tcp://127.0.0.1:5555", "--port", "0", "--admin-key-file", str(key_file)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRON_SERVE_API_KEY": "same"})
    assert done.returncode == 1 and "must differ from the API key" in done.stderr
