"""The HTTP layer against a fake backend, served by uvicorn on 127.0.0.1: shapes, errors, aborts, limits.

Fast (no model, no processes): every error status and its OpenAI body, streaming framing, the
queue limit, readiness, and that a client that leaves aborts its requests.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve.client.coordinator_client import StreamPartial
from megatron_serve.wire.request import DynamicInferenceRequest, EventType, FinishReason
from megatron_serve.server import create_app

from ..helpers import until
from .conftest import metric, serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"


def make_app(tokenizer, backend, **kwargs):
    return create_app(backend, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = "<any>", code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "<any>":
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer)


#: The RL frameworks' own routes (server/rl): vLLM's RL and control API, SGLang's native API, TRL's and prime-rl's.
RL_FRAMEWORK_PATHS = {
    # vLLM
    "/pause", "/resume", "/is_paused", "/abort_requests", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
    "/get_world_size", "/server_info", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/update_weight_version", "/weight_info", "/weight_checker", "/collective_rpc",
    "/inference/v1/generate", "/v1/chat/completions/render",
    # SGLang
    "/get_server_info", "/generate", "/health_generate", "/flush_cache", "/abort_request", "/pause_generation",
    "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/weights_checker", "/v1/loads",
    # AReaL's, SkyRL's, this project's
    "/areal_update_weights", "/areal_init_weights_update_group", "/areal_set_update_weight_meta",
    "/areal_update_weights_xccl", "/areal_update_weights_lora", "/areal_update_weights_lora_xccl",
    "/areal_set_update_weight_meta_lora", "/areal_pause_generation", "/areal_continue_generation", "/finish_session",
    "/abort_weight_update",
    # TRL <= 1.10
    "/health/", "/get_world_size/", "/generate/", "/chat/", "/get_sequence_logprobs/", "/init_communicator/",
    "/update_named_param/", "/reset_prefix_cache/", "/close_communicator/",
    # prime-rl
    "/init_broadcaster", "/liveness",
}


async def test_openapi_documents_every_route_and_no_422(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        doc = (await http.get("/openapi.json")).json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
                                 "/health", "/ready", "/metrics", "/tokenize", "/detokenize",
                                 *(f"/v1/admin/{verb}" for verb in ("pause", "unpause", "suspend", "resume", "refit",
                                                                    "reset_prefix_cache", "status")),
                                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", *RL_FRAMEWORK_PATHS}
    assert "422" not in json.dumps(doc["paths"])
    post = doc["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "429", "500", "503"} <= set(post["responses"])
    assert "text/event-stream" in post["responses"]["200"]["content"]
    schemes = doc["components"]["securitySchemes"]
    assert set(schemes) == {"AdminKey"}  # no API key configured: only the admin routes' key is documented
    keyed = make_app(tokenizer, backend, api_key="k").openapi()
    assert set(keyed["components"]["securitySchemes"]) == {"HTTPBearer", "AdminKey"}
    assert "401" in keyed["paths"]["/v1/chat/completions"]["post"]["responses"]


BAD_BODIES = [
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature", None),
    ({"model": MODEL, "prompt": "x", "temperature": "warm"}, "temperature", None),  # "1" is read as 1, as in vLLM
    ({"model": MODEL, "prompt": "x", "max_tokens": "1.5"}, "max_tokens", None),
    ({"model": MODEL, "prompt": "x", "temperature": "2.5"}, "temperature", None),  # a number, out of range
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", None),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop", None),
    ({"model": MODEL, "prompt": "x", "stream": 1}, "stream", None),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt", None),
    ({"model": MODEL, "prompt": ["a", [1]]}, "prompt", None),
    ({"model": MODEL, "prompt": []}, "prompt", None),
    ({"model": MODEL, "prompt": [-1]}, "prompt", None),
    ({"model": MODEL, "prompt": "x", "seed": 2**64}, "seed", None),
    ({"model": 3, "prompt": "x"}, "model", None),
]


async def test_invalid_bodies_are_openai_400s(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for body, param, code in BAD_BODIES:
            assert_error(await http.post("/v1/completions", json=body), 400, param, code)
        assert_error(await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                     400, None, "invalid_json")
        assert_error(await http.post("/v1/completions", json=[1, 2]), 400)
        chat = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
        assert_error(await http.post("/v1/chat/completions", json=chat), 400, "messages[0].role")
        chat = {"model": MODEL, "messages": []}
        assert_error(await http.post("/v1/chat/completions", json=chat), 400, "messages")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
        assert_error(await http.post("/v1/chat/completions", json=chat), 400)
    assert backend.submitted == []  # nothing reached the fleet


async def test_unknown_model_is_a_404_with_the_openai_error_body(tokenizer, backend):
    user = [{"role": "user", "content": "hi"}]
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for path, body in [("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
                           ("/v1/chat/completions", {"model": "gpt-4", "messages": user}),
                           ("/v1/completions", {"model": "gpt-4", "prompt": "x", "stream": True}),
                           ("/tokenize", {"model": "gpt-4", "prompt": "x"}),
                           ("/detokenize", {"model": "gpt-4", "tokens": [5]})]:
            error = assert_error(await http.post(path, json=body), 404, "model", "model_not_found")
            assert error["type"] == "invalid_request_error" and "'gpt-4' does not exist" in error["message"]
    assert backend.submitted == []


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


async def test_semantic_errors_are_400s(tokenizer, backend):
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": [7] * 64}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * 10, "max_tokens": 55}, "max_tokens",
         "context_length_exceeded"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "max_completion_tokens": 64},
         "max_completion_tokens", "context_length_exceeded"),
        ("/v1/completions", {"model": MODEL, "prompt": [600]}, "prompt", "invalid_token_id"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias", "invalid_token_id"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"600": 1.0}}, "logit_bias",
         "invalid_token_id"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a("}, "guided_regex",
         "invalid_constraint"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_grammar": "root ::= missing"}, "guided_grammar",
         "invalid_constraint"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"},
         "guided_regex", "conflicting_parameters"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo",
         None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
         None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of", None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "top_logprobs": 2}, "top_logprobs", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "tools": [{"type": "function"}]},
         "tools[0].function", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "tool_choice": "required"}, "tool_choice", None),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "tools": [TOOL],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         None),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "tools": [TOOL], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice",
         "conflicting_parameters"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "response_format": {"type": "json_schema"}},
         "response_format.json_schema", None),
    ]
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for path, body, param, code in cases:
            error = assert_error(await http.post(path, json=body), 400, param, code)
            assert error["type"] == "invalid_request_error"
        assert_error(await http.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
        assert_error(await http.get("/v1/nothing"), 404)
        error = assert_error(await http.delete("/v1/completions"), 405)
        assert error["code"] == "method_not_allowed"
    assert backend.submitted == []


async def test_api_key(tokenizer, backend):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with serving(make_app(tokenizer, backend, api_key="s3cret")) as url, httpx.AsyncClient(base_url=url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic czNjcmV0"},
                        {"Authorization": "Bearer"}):
            response = await http.post("/v1/completions", json=body, headers=headers)
            assert_error(response, 401, None, "invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
            assert_error(await http.get("/v1/models", headers=headers), 401)
        ok = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, ok.text
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no credentials
            assert (await http.get(path)).status_code == 200


async def test_stopped_or_unreachable_fleet_is_503_and_not_ready(tokenizer, backend):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/ready")).json()["ready"] is True
        backend.state = "STOPPED"
        await until(lambda: backend.state == "STOPPED", 1, "state")
        for _ in range(100):
            ready = await http.get("/ready")
            if ready.status_code == 503:
                break
            await asyncio.sleep(0.02)
        assert ready.status_code == 503 and ready.json()["state"] == "STOPPED"
        assert_error(await http.post("/v1/completions", json=body), 503, None, "fleet_stopped")
        backend.state, backend.reachable = "RUNNING", False
        for _ in range(200):
            ready = await http.get("/ready")
            if ready.json()["coordinator_reachable"] is False:
                break
            await asyncio.sleep(0.02)
        assert ready.status_code == 503
        error = assert_error(await http.post("/v1/chat/completions",
                                             json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                             503, None, "coordinator_unreachable")
        assert "coordinator" in error["message"]
        assert "megatron_serve_coordinator_reachable 0.0" in (await http.get("/metrics")).text
        backend.reachable = True
        for _ in range(200):
            if (await http.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    assert len(backend.submitted) == 1


async def test_paused_fleet_holds_requests_and_queue_limit_is_429(tokenizer, backend):
    backend.gate.clear()
    backend.state = "PAUSED"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    async with serving(make_app(tokenizer, backend, max_concurrent_requests=3)) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        ready = await http.get("/ready")  # paused is not ready (requests wait): a balancer should look elsewhere
        assert ready.status_code == 503 and ready.json()["state"] == "PAUSED", ready.text
        assert "the fleet is PAUSED: requests wait until it runs again" in ready.json()["detail"]
        held = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
        await until(lambda: len(backend.submitted) == 3, 10, "3 held requests")
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "megatron_serve_server_pending_requests") == 3
        assert metric(metrics, "megatron_serve_lifecycle_state", 'state="PAUSED"') == 1
        response = await http.post("/v1/completions", json=body)
        error = assert_error(response, 429, None, "queue_full")
        assert error["type"] == "rate_limit_error" and response.headers["retry-after"]
        assert not any(task.done() for task in held)
        backend.state = "RUNNING"
        backend.gate.set()
        assert (await http.get("/ready")).status_code == 200  # the state as of now, not as of the last poll
        answers = await asyncio.gather(*held)
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert_error(await http.post("/v1/completions", json={**body, "n": 4}), 429)  # n=4 never fits in 3
        assert (await http.post("/v1/completions", json={**body, "n": 3})).status_code == 200


async def test_client_disconnect_aborts_waiting_and_streaming_requests(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        backend.gate.clear()  # held: the client gives up while its request waits
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2},
                            timeout=httpx.Timeout(0.5, connect=30))  # a loaded machine's connect is no give-up
        await until(lambda: len(backend.aborted) == 2, 10, "both choices aborted")
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "megatron_serve_requests_total", 'status="aborted"') == 2
        assert metric(metrics, "megatron_serve_server_pending_requests") == 0
        backend.gate.set()
        backend.token_delay = 0.02  # mid-stream: leave after two chunks
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "max_completion_tokens": 40}
        metrics = await left_mid_stream(http, backend, "/v1/chat/completions", body, events=2, aborted=3)
        assert metric(metrics, "megatron_serve_num_requests_running", f'engine_group="0",model_name="{MODEL}"') == 0


async def left_mid_stream(http: httpx.AsyncClient, backend: FakeBackend, path: str, body: dict, *, events: int,
                          aborted: int) -> str:
    """A streamed request to ``path`` left after ``events`` events: waits until the backend has aborted ``aborted``
    requests in all and runs none, checks that ``/metrics`` counts them aborted, and returns ``/metrics``."""
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        await read_events(response, events)
    await until(lambda: len(backend.aborted) == aborted and not backend.running, 10, f"{aborted} requests aborted")
    metrics = (await http.get("/metrics")).text
    assert metric(metrics, "megatron_serve_requests_total", 'status="aborted"') == aborted
    return metrics


async def read_events(response: httpx.Response, count: int) -> None:
    """Read ``count`` SSE data lines of a streamed response, then leave the rest unread."""
    lines = response.aiter_lines()
    seen = 0
    while seen < count:
        if (await lines.__anext__()).startswith("data: "):
            seen += 1


def stream_body(path: str, **fields) -> dict:
    """A streamed request of either endpoint: the same fields, in each endpoint's words."""
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, **fields}
    return {"model": MODEL, "prompt": "Hi", "stream": True, **fields}


def failed_request(request_id: str | None, prompt: list[int], params, error: str, prefilled: bool
                   ) -> DynamicInferenceRequest:
    """The record of a request the engine ended with ``error``: after running it (``prefilled``), or refused before."""
    request = DynamicInferenceRequest(request_id=request_id, prompt=None, prompt_tokens=list(prompt),
                                      sampling_params=params)
    if prefilled:
        request.add_event(EventType.PREFILL)
    request.fail(error, FinishReason.ERROR)
    return request


def fail_streams(backend: FakeBackend, after: int, *, prefilled: bool) -> None:
    """Each engine stream sends ``after`` one-token pieces, then a failed record: an engine that failed
    while generating (``prefilled``), or that refused the request before running it."""

    async def failing(prompt, params, *, request_id=None):
        for i in range(after):
            yield StreamPartial(request_id, [FakeBackend.next_token(prompt, i, params.seed)], "ab", [-0.5])
        yield failed_request(request_id, prompt, params, "out of KV blocks", prefilled)

    backend.add_request_streaming = failing


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_error_mid_stream_is_an_error_event_then_done_and_aborts_the_siblings(tokenizer, backend, path):
    fail_streams(backend, after=2, prefilled=True)
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post(path, json=stream_body(path, n=2, max_tokens=8))
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": {
            "message": "the engine failed while generating: out of KV blocks", "type": "server_error", "param": None,
            "code": "engine_error"}}
        chunks = [json.loads(e) for e in events[:-2]]
        assert chunks and all("error" not in c and c["choices"] for c in chunks)  # the text sent before the failure
        # The first failure ends the answer: the other choice is aborted, nothing is left pending.
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "megatron_serve_requests_total", 'status="failed"') == 1
        assert metric(metrics, "megatron_serve_requests_total", 'status="aborted"') == 1
        assert metric(metrics, "megatron_serve_server_pending_requests") == 0
    assert len(backend.aborted) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_error_before_the_first_event_of_a_stream_is_an_http_error(tokenizer, backend, path):
    fail_streams(backend, after=0, prefilled=False)
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        error = assert_error(await http.post(path, json=stream_body(path, max_tokens=8)), 400, None,
                             "invalid_request")
        assert error["message"] == "the engine refused the request: out of KV blocks"
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "megatron_serve_requests_total", 'status="failed"') == 1
        assert metric(metrics, "megatron_serve_server_pending_requests") == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_client_leaving_a_stream_aborts_every_choice(tokenizer, backend, path):
    backend.token_delay = 0.02
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        metrics = await left_mid_stream(http, backend, path, stream_body(path, n=2, max_tokens=40), events=3, aborted=2)
        assert metric(metrics, "megatron_serve_server_pending_requests") == 0


async def test_streaming_framing_matches_the_whole_answer(tokenizer, backend):
    body = {"model": MODEL, "prompt": [[40, 41, 42], [5, 6, 7]], "n": 2, "max_tokens": 6, "echo": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5, "n": 2,
            "logprobs": True}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        whole = (await http.post("/v1/completions", json=body)).json()
        streamed = await http.post("/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for chunk in chunks[:-1]:
            assert chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"]
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
        assert sorted(texts) == [0, 1, 2, 3]
        for choice in whole["choices"]:
            assert texts[choice["index"]] == choice["text"]
            assert finish[choice["index"]] == choice["finish_reason"] == "length"
        assert whole["choices"][0]["text"].startswith(tokenizer.decode([40, 41, 42]))
        assert whole["usage"]["completion_tokens"] == 4 * 6

        whole_chat = (await http.post("/v1/chat/completions", json=chat)).json()
        events = sse_events((await http.post("/v1/chat/completions", json={**chat, "stream": True})).text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        firsts = {}
        contents: dict[int, str] = {}
        tokens: dict[int, int] = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            firsts.setdefault(choice["index"], choice["delta"])
            contents[choice["index"]] = contents.get(choice["index"], "") + (choice["delta"].get("content") or "")
            tokens[choice["index"]] = tokens.get(choice["index"], 0) + len((choice.get("logprobs") or {}).get("content") or [])
            if choice["finish_reason"]:
                assert choice["delta"] == {}  # the last chunk of a choice changes nothing
        assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
        for choice in whole_chat["choices"]:
            assert contents[choice["index"]] == choice["message"]["content"]
            assert tokens[choice["index"]] == len(choice["logprobs"]["content"]) == 5


async def test_stop_sequences_and_logprob_shapes(tokenizer, backend):
    probe = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "logprobs": 3}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        answer = (await http.post("/v1/completions", json=probe)).json()
        (choice,) = answer["choices"]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
        assert all(1 <= len(top) <= 4 for top in logprobs["top_logprobs"])  # the token itself and its 3 best (vLLM)
        assert logprobs["text_offset"][0] == 0
        text = choice["text"]
        stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
        stopped = (await http.post("/v1/completions", json={**probe, "stop": [stop, "zzzz"]})).json()
        assert stopped["choices"][0]["text"] == text[: text.index(stop)]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        streamed = sse_events((await http.post("/v1/completions", json={**probe, "stop": stop, "stream": True})).text)
        pieces = [json.loads(e)["choices"][0] for e in streamed[:-1]]
        assert "".join(p["text"] for p in pieces) == text[: text.index(stop)]
        assert pieces[-1]["finish_reason"] == "stop"


async def test_engine_refusal_is_400_and_engine_failure_is_500(tokenizer, backend):
    def failing(prompt, params, *, request_id=None, prefilled=False):
        future = asyncio.get_running_loop().create_future()
        future.set_result(failed_request(request_id, prompt, params, "request needs 99 KV blocks", prefilled))
        return future

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        backend.add_request = failing
        error = assert_error(await http.post("/v1/completions", json=body), 400, None, "invalid_request")
        assert "99 KV blocks" in error["message"]
        backend.add_request = lambda *a, **k: failing(*a, **k, prefilled=True)
        assert_error(await http.post("/v1/completions", json=body), 500, None, "engine_error")

        def broken(*_a, **_k):
            raise KeyError("boom")

        backend.add_request = broken
        assert_error(await http.post("/v1/completions", json=body), 500)
        metrics = (await http.get("/metrics")).text
        assert metric(metrics, "megatron_serve_requests_total", 'status="failed"') == 3
        assert metric(metrics, "megatron_serve_requests_total", 'status="aborted"') == 0
        assert metric(metrics, "megatron_serve_server_pending_requests") == 0


async def test_degenerate_sampling_values_mean_greedy_and_seeds_differ_per_choice(tokenizer, backend):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 5e-324, "top_p": 5e-324,
            "top_k": -1, "seed": -3, "n": 2, "stop": "x"}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    (_, first), (_, second) = backend.submitted
    assert first.is_greedy  # the engine decodes such temperatures greedily, never logits / 5e-324
    assert first.stop_words == ["x"] and first.num_tokens_to_generate == 2
    assert {(first.seed, first.sample_index), (second.seed, second.sample_index)} == {((-3) % 2**63, 0),
                                                                                      ((-3) % 2**63, 1)}


def test_listening_socket_is_tcp_so_connections_get_nodelay():
    """asyncio sets TCP_NODELAY on accepted sockets only when proto is TCP; without it keep-alive
    responses stall ~40 ms on delayed ACKs."""
    import socket  # noqa: PLC0415

    from megatron_serve.server.runner import bind_socket  # noqa: PLC0415

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
