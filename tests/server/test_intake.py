"""The front door against a fake backend: strict bodies, the one list of extensions, request limits, and
tokenization that never holds up ``/health``.

Each case was answered wrongly before: unknown fields and vLLM's sampling extras got 200 with
unchanged output, a body of any size was read and tokenized on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import typing

import httpx
import pytest

from megatron_serve.limits import PROMPT_CHARS_PER_CONTEXT_TOKEN, RequestLimits
from megatron_serve.server import intake
from megatron_serve.server.extensions import EXTENSIONS, NOT_IMPLEMENTED
from megatron_serve.server.models import ChatCompletionRequest, ChatMessage, CompletionRequest

from .conftest import serving
from .fakes import FakeBackend
from .test_app import MODEL, assert_error, make_app

pytestmark = pytest.mark.timeout(180)

USER = [{"role": "user", "content": "hi"}]

# The request fields of the OpenAI API (https://platform.openai.com/docs/api-reference) that the models declare.
OPENAI_COMPLETION_FIELDS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                            "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                            "suffix", "temperature", "top_p", "user"}
OPENAI_CHAT_FIELDS = {"model", "messages", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
                      "max_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
                      "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                      "parallel_tool_calls"}


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(tokenizer, max_sequence_length=1024)


def test_one_list_of_extensions_matches_the_declared_fields():
    completion_extras = set(CompletionRequest.model_fields) - OPENAI_COMPLETION_FIELDS
    chat_extras = set(ChatCompletionRequest.model_fields) - OPENAI_CHAT_FIELDS
    assert completion_extras | chat_extras == set(EXTENSIONS)
    assert not set(NOT_IMPLEMENTED) & (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage):
        assert model.model_config["extra"] == "forbid"


UNKNOWN = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_new_tokens": 5}, "max_new_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "weight": 1}]},
     "messages[0].weight"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True,
                                                                                           "chunked": True}},
     "stream_options.chunked"),
]


# The cases of each table below run against one server (one started per case before, the most of their CPU).


async def test_unknown_fields_are_400s_that_name_them(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for path, body, param in UNKNOWN:
            error = assert_error(await http.post(path, json=body), 400, param, "unknown_parameter")
            assert param in error["message"] and "top_k" in error["message"], param  # says what is accepted instead
    assert backend.submitted == []


VLLM_EXTRAS = [("bad_words", ["x"]), ("spaces_between_special_tokens", False)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_sampling_extras_this_server_lacks_are_refused_not_ignored(tokenizer, backend, path):
    body = {"model": MODEL, "prompt": "x"} if path == "/v1/completions" else {"model": MODEL, "messages": USER}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for field, value in VLLM_EXTRAS:
            error = assert_error(await http.post(path, json={**body, field: value}), 400, field,
                                 "unsupported_parameter")
            assert "not supported" in error["message"], field
            several = await http.post(path, json={**body, field: value, "foo": 1, "bar": 2})
            error = assert_error(several, 400, field)
            assert "foo" in error["message"] and "bar" in error["message"], field  # every unknown field is named
            assert (await http.post(path, json={**body, "top_k": 3, "ignore_eos": True})).status_code == 200
            assert len(backend.submitted) == 1, field  # only the accepted request reached the engine
            backend.submitted.clear()


MALFORMED = [
    (b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', "invalid UTF-8"),
    (b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', "lone surrogate"),
    (b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deep nesting"),
    (b"", "empty"),
]


async def test_malformed_bodies_are_400s(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        for body, _ in MALFORMED:
            assert_error(await http.post("/v1/completions", content=body,
                                         headers={"content-type": "application/json"}), 400, None, "invalid_json")
    assert backend.submitted == []


class CountingTokenizer:
    """The real tokenizer, counting what it is asked to tokenize or render."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)


OVER_LIMITS = [
    ("/v1/completions", {"prompt": "x", "n": 5}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "y" * 11}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0, "6": 1.0, "7": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER * 4}, "messages"),
    ("/v1/completions", {"prompt": "x" * 101}, "prompt"),
    ("/v1/completions", {"prompt": ["x" * 60, "y" * 60]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 101}]}, "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1024}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a", "b", "c", "d"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a" * 30, "b" * 30]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": USER, "guided_regex": "x" * 51}, "guided_regex"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["v" * 50]}}}}, "response_format"),
]


async def test_requests_over_a_limit_are_refused_before_tokenization(tokenizer, backend):
    limits = RequestLimits(max_n=4, max_stop=3, max_stop_chars=10, max_logit_bias=2, max_messages=3,
                           max_prompt_chars=100, max_guided_choices=3, max_constraint_bytes=50)
    counting = CountingTokenizer(tokenizer)
    async with serving(make_app(counting, backend, limits=limits)) as url, httpx.AsyncClient(base_url=url) as http:
        for number, (path, fields, param) in enumerate(OVER_LIMITS):
            error = assert_error(await http.post(path, json={"model": MODEL, **fields}), 400, param)
            assert "at most" in error["message"] or "maximum context length" in error["message"], number
            assert counting.calls == 0 and backend.submitted == [], number


async def test_prompts_times_n_over_max_choices_is_refused_before_tokenization(tokenizer, backend):
    """Issue 86's request: 5,000 prompts x n 32 (160,000 engine requests in 40 KB) is a 400 naming --max-choices by
    default; a request at the limit passes, one over it by prompts alone or by n is refused, nothing tokenized."""
    counting = CountingTokenizer(tokenizer)
    async with serving(make_app(counting, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        fan_out = await http.post("/v1/completions", json={"model": MODEL, "prompt": ["x"] * 5000, "n": 32,
                                                            "max_tokens": 1})
        error = assert_error(fan_out, 400, "n", "too_many_choices")
        assert "160000 choices (5000 prompts x n=32)" in error["message"], error
        assert "maximum of 16384 per request (--max-choices)" in error["message"], error
        assert counting.calls == 0 and backend.submitted == []
    limits = RequestLimits(max_choices=6)
    async with serving(make_app(counting, backend, limits=limits)) as url, httpx.AsyncClient(base_url=url) as http:
        for fields, param in (({"prompt": ["x"] * 4, "n": 2}, "n"), ({"prompt": [[1, 2]] * 7}, "prompt")):
            assert_error(await http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, **fields}), 400,
                         param, "too_many_choices")
        assert counting.calls == 0 and backend.submitted == []
        fits = await http.post("/v1/completions", json={"model": MODEL, "prompt": ["x"] * 3, "n": 2, "max_tokens": 1})
        assert fits.status_code == 200, fits.text
        assert len(backend.submitted) == 6


async def test_a_constraint_that_takes_too_long_to_check_is_a_400_that_says_so(tokenizer, backend):
    """The check has a deadline: past it the request is refused and nothing reaches an engine."""
    grammar = "start: " + " | ".join(f'"c{i}"' for i in range(20_000))  # checked in 0.4 s on an idle core
    limits = RequestLimits(grammar_compile_timeout=0.05, max_constraint_bytes=1 << 20)
    async with serving(make_app(tokenizer, backend, limits=limits)) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_grammar": grammar})
        fine = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                        "guided_regex": "[ab]+"})
    error = assert_error(response, 400, "guided_grammar", "invalid_constraint")
    assert "could not be checked within 0.05s" in error["message"], error
    assert fine.status_code == 200 and len(backend.submitted) == 1


def test_prompt_character_limit_follows_the_context_unless_given():
    assert RequestLimits().prompt_chars(1024) == PROMPT_CHARS_PER_CONTEXT_TOKEN * 1024
    assert RequestLimits(max_prompt_chars=7).prompt_chars(1024) == 7
    assert RequestLimits().prompt_chars(None) is None
    with pytest.raises(ValueError, match="--max-n"):
        RequestLimits(max_n=0)


async def test_oversized_bodies_get_413_in_the_openai_shape(tokenizer, backend):
    limits = RequestLimits(max_body_bytes=10_000)
    big = b'{"model": "tiny-llama", "prompt": "' + b"x" * 20_000 + b'"}'

    async def chunked():  # no Content-Length: the limit applies while the body is read
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with serving(make_app(tokenizer, backend, limits=limits)) as url, httpx.AsyncClient(base_url=url) as http:
        declared = await http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        error = assert_error(declared, 413, None, "request_too_large")
        assert "10000 bytes" in error["message"] and "--max-request-bytes" in error["message"]
        assert_error(await http.post("/v1/chat/completions", content=chunked(),
                                     headers={"content-type": "application/json"}), 413, None, "request_too_large")
        # the connection stays usable and small requests pass
        ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert len(backend.submitted) == 1


async def probe_health(url: str, stop: asyncio.Event, answered: list[float]) -> None:
    """GET /health every 100 ms until ``stop``; records when each answer came (``perf_counter``; an error fails)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            response = await http.get("/health")
            assert response.status_code == 200, response.text
            answered.append(time.perf_counter())
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("on_the_loop", [False, True], ids=["worker-thread", "control-on-the-loop"])
async def test_health_answers_while_a_huge_prompt_is_tokenized(tokenizer, backend, monkeypatch, on_the_loop):
    """2 M characters take seconds to tokenize here; /health keeps answering all the while. Counted, not timed:
    the probe's answers that came while the tokenizer ran. The control tokenizes the body on the event loop (as a
    small body is): then not one answer comes until the tokenizer is done."""
    if on_the_loop:
        monkeypatch.setattr(intake, "INLINE_BODY_BYTES", 8 << 20)
    runs: list[tuple[float, float]] = []
    encode = tokenizer.encode

    def timed_encode(*args, **kwargs):  # the real tokenizer, with when it ran noted
        began = time.perf_counter()
        try:
            return encode(*args, **kwargs)
        finally:
            runs.append((began, time.perf_counter()))

    monkeypatch.setattr(tokenizer, "encode", timed_encode)
    limits = RequestLimits(max_body_bytes=8 << 20, max_prompt_chars=2_000_000)
    prompt = "the quick brown fox jumps over the lazy dog; " * 44_000
    answered: list[float] = []
    stop = asyncio.Event()
    async with serving(make_app(tokenizer, backend, limits=limits)) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as http:
        prober = asyncio.create_task(probe_health(url, stop, answered))
        while not answered:  # the probe is under way before the prompt goes
            await asyncio.sleep(0.01)
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        stop.set()
        await prober
    error = assert_error(response, 400, "prompt", "context_length_exceeded")  # tokenized, then too long
    assert "tokens" in error["message"]
    [(began, ended)] = runs
    while_tokenizing = [when for when in answered if began < when < ended]
    if on_the_loop:
        assert while_tokenizing == [], f"{len(while_tokenizing)} answers while the loop itself tokenized"
    else:
        assert len(while_tokenizing) >= 3, (f"{len(while_tokenizing)} /health answers in the tokenizer's "
                                            f"{ended - began:.2f} s", len(answered))


async def raw_exchange(url: str, data: bytes, *, wait: float) -> bytes:
    """Send ``data`` on a fresh connection, then read whatever the server answers within ``wait`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait)  # until the server closes the connection
    finally:
        writer.close()


async def serving_with(app, **options):
    """Like ``conftest.serving`` but with ``serve_app`` options; yields (url, stop event, task)."""
    from megatron_serve.server.runner import bind_socket, serve_app

    sock = bind_socket("127.0.0.1", 0)
    stop = asyncio.Event()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_app(app, sock=sock, stop=stop, on_started=started.set_result, **options))
    await asyncio.wait_for(asyncio.shield(started), 30)
    return started.result(), stop, task


@pytest.mark.parametrize("partial", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 100\r\n\r\n{\"model\": \"tiny"],
                         ids=["headers", "body"])
async def test_a_request_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(tokenizer, backend, partial):
    url, stop, task = await serving_with(make_app(tokenizer, backend), read_timeout=0.5)
    try:
        began = time.perf_counter()
        answer = await raw_exchange(url, partial, wait=10)
        took = time.perf_counter() - began
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.4 < took < 5, took
        async with httpx.AsyncClient(base_url=url) as http:  # the server is fine
            assert (await http.get("/health")).status_code == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert backend.submitted == []


async def test_malformed_http_gets_an_openai_400(tokenizer, backend):
    url, stop, task = await serving_with(make_app(tokenizer, backend))
    try:
        answer = await raw_exchange(url, b"BLAH\x00 / HTTP/1.1\r\n\r\n", wait=10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http", answer


async def test_stopping_server_answers_held_and_streaming_requests_with_503(tokenizer, backend, caplog):
    backend.token_delay = 0.05
    url, stop, task = await serving_with(make_app(tokenizer, backend), graceful_timeout=30)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to caplog's root handler
    uvicorn_log.addHandler(caplog.handler)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        streaming = http.stream("POST", "/v1/completions",
                                json={"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True})
        response = await streaming.__aenter__()
        assert response.status_code == 200
        lines = response.aiter_lines()
        assert (await lines.__anext__()).startswith("data: {")  # streaming has begun
        backend.gate.clear()  # a paused fleet: the next request is held
        held = asyncio.create_task(http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}))
        while len(backend.submitted) < 2:
            await asyncio.sleep(0.02)
        began = time.perf_counter()
        stop.set()
        answer = await held
        rest = [line async for line in lines if line.startswith("data: ")]
        await streaming.__aexit__(None, None, None)
        await asyncio.wait_for(task, 30)
        took = time.perf_counter() - began
    error = assert_error(answer, 503, None, "server_shutting_down")
    assert "shutting down" in error["message"]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
    assert took < 10, took  # answered at once, not after uvicorn's graceful-shutdown timeout
    assert len(backend.aborted) == 2  # both engine requests were given up
    uvicorn_log.removeHandler(caplog.handler)
    assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text


async def test_implemented_extensions_reach_the_engine_as_sampling_params(tokenizer, backend):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 2,
            "stop_token_ids": [5], "guided_choice": ["a", "b"], "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "logit_bias": {"7": 2.0}, "prompt_logprobs": 2}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    params = backend.submitted[0][1]
    assert (params.repetition_penalty, params.min_p, params.min_tokens, params.stop_token_ids) == (1.3, 0.1, 2, [5])
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, 0.25, {7: 2.0})
    assert params.structured_outputs.choice == ["a", "b"]
    assert params.return_prompt_log_probs and params.top_n_logprobs == 2


async def test_a_client_leaving_while_sending_its_body_is_no_error(tokenizer, backend, caplog):
    caplog.set_level(logging.DEBUG, logger="megatron_serve.server")
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    url, stop, task = await serving_with(make_app(tokenizer, backend))
    try:
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        await writer.drain()
        writer.close()
        async with httpx.AsyncClient(base_url=url) as http:
            while "while sending its body" not in caplog.text:
                await asyncio.sleep(0.02)
            metrics = (await http.get("/metrics")).text
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        uvicorn_log.removeHandler(caplog.handler)
    left = [r for r in caplog.records if "while sending its body" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.DEBUG  # once, at debug level
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert 'code="500"' not in metrics


async def test_a_client_that_leaves_is_logged_once_at_debug_level(tokenizer, backend, caplog):
    caplog.set_level(logging.DEBUG, logger="megatron_serve.server")
    backend.token_delay = 0.02
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2,
                                                                "max_tokens": 100, "stream": True}) as response:
            lines = response.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
        backend.gate.clear()
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=0.5)
        while len(backend.aborted) < 3:
            await asyncio.sleep(0.02)
        backend.gate.set()
    departures = [r for r in caplog.records if " left " in r.getMessage()]
    assert [r.levelno for r in departures] == [logging.DEBUG, logging.DEBUG], caplog.text
    assert "left its stream" in departures[0].getMessage() and "before its answer" in departures[1].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_tokenize_routes_go_through_the_same_front_door(tokenizer, backend):
    limits = RequestLimits(max_prompt_chars=100, max_messages=2)
    counting = CountingTokenizer(tokenizer)
    async with serving(make_app(counting, backend, limits=limits)) as url, httpx.AsyncClient(base_url=url) as http:
        async def post(path: str, body: bytes) -> httpx.Response:
            return await http.post(path, content=body, headers={"content-type": "application/json"})

        assert_error(await post("/tokenize", b'{"prompt": "a\\ud800b"}'), 400, None, "invalid_json")  # was a 500
        assert_error(await post("/tokenize", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400, None,
                     "invalid_json")
        assert_error(await post("/tokenize", json.dumps({"prompt": "x" * 101}).encode()), 400, "prompt")
        assert_error(await post("/tokenize", json.dumps({"messages": USER * 3}).encode()), 400, "messages")
        assert_error(await post("/tokenize", b'{"prompt": "x", "foo": 1}'), 400, "foo", "unknown_parameter")
        assert_error(await post("/detokenize", b'{"tokens": [1], "bar": 2}'), 400, "bar", "unknown_parameter")
        assert counting.calls == 0
        ok = await post("/tokenize", b'{"prompt": "hello"}')
        assert ok.status_code == 200 and ok.json()["count"] == len(tokenizer.encode("hello"))
        text = (await post("/detokenize", json.dumps({"tokens": ok.json()["tokens"]}).encode())).json()["prompt"]
        assert text == "hello"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_min_tokens_over_max_tokens_is_named_as_the_client_wrote_it(tokenizer, backend, path):
    """It said "exceeds num_tokens_to_generate", this project's internal name (issue 54); now vLLM's words."""
    body = {"model": MODEL, "prompt": "x"} if path == "/v1/completions" else {"model": MODEL, "messages": USER}
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url) as http:
        error = assert_error(await http.post(path, json={**body, "min_tokens": 10, "max_tokens": 5}), 400,
                             "min_tokens")
    assert error["message"] == "min_tokens must be less than or equal to max_tokens=5, got 10"
    assert backend.submitted == []
