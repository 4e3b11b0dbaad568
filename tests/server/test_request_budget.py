"""The request budget (``--max-request-logprobs``, ``--max-response-bytes``) and large answers written in pieces.

Before, ``n=128``, ``prompt_logprobs=20`` and ``logprobs=20`` on a 1,000-token prompt (each within its own
limit) were served: a 184 MB answer, built whole and serialized on the event loop, which stalled every other
request. Now such a request is a 400 naming the budget and its figure before anything is submitted, and an
answer within the budget is built and written one choice at a time off the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import statistics
import time
from typing import Any, AsyncIterator

import httpx
import pytest

from megatron_serve.heap import defer_young_collections, freeze_startup_heap
from megatron_serve.limits import DEFAULT_MAX_REQUEST_LOGPROBS, DEFAULT_MAX_RESPONSE_BYTES, RequestLimits
from megatron_serve.server import whole_answers as pieces
from megatron_serve.wire.request import DynamicInferenceRequest
from megatron_serve.wire.sampling_params import SamplingParams

from .conftest import serving
from .fakes import FakeBackend
from .test_app import MODEL, assert_error, make_app

pytestmark = pytest.mark.timeout(300)

PROMPT = [5 + i % 400 for i in range(1000)]  # 1,000 token ids of the tiny vocabulary
AMPLIFYING = {"model": MODEL, "prompt": PROMPT, "n": 128, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 16}


class ScoringBackend(FakeBackend):
    """The fake fleet, with prompt log probs in the final record of a request that asks for them (as the client's
    output processor fills them from an engine's prompt scores); made once per prompt and count, so that the fake's
    own work stays off the measure."""

    scores: dict[tuple[tuple[int, ...], int], tuple[list[float], list[dict[int, float]]]] = {}

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        ) -> AsyncIterator[Any]:
        async for item in super()._generate(request_id, prompt, params):
            if isinstance(item, DynamicInferenceRequest) and params.return_prompt_log_probs:
                k = params.top_n_logprobs
                key = (tuple(prompt), k)
                if key not in self.scores:
                    self.scores[key] = ([-1.0 - i / 1000 for i in range(len(prompt) - 1)],
                                        [{token: -1.0, **{10 + j: -2.0 - j / 10 for j in range(k)}}
                                         for token in prompt[1:]])
                item.prompt_log_probs, item.prompt_top_n_logprobs = self.scores[key]
            yield item


@pytest.fixture
def backend(tokenizer):
    return ScoringBackend(tokenizer, max_sequence_length=1024)


async def test_an_amplifying_request_is_refused_with_its_figure_before_any_work(tokenizer, backend):
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        error = assert_error(await http.post("/v1/completions", json=AMPLIFYING), 400, code="over_budget")
        # 128 choices x (999 prompt positions + 16 tokens) x (20 + 1)
        assert "2,728,320 log probs" in error["message"] and "--max-request-logprobs" in error["message"]
        assert f"{DEFAULT_MAX_REQUEST_LOGPROBS:,}" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 250}], "n": 128,
                "prompt_logprobs": 20, "logprobs": True, "top_logprobs": 20, "max_tokens": 16}
        error = assert_error(await http.post("/v1/chat/completions", json=chat), 400, code="over_budget")
        assert "--max-request-logprobs" in error["message"]
        assert (await http.post("/v1/completions", json={**AMPLIFYING, "n": 1})).status_code == 200
    assert len(backend.submitted) == 1  # only the one within the budget reached the fleet


async def test_the_answer_bytes_budget_counts_every_choice_s_tokens(tokenizer, backend):
    app = make_app(tokenizer, backend, limits=RequestLimits(max_response_bytes=100_000))
    body = {"model": MODEL, "prompt": "hi", "n": 16, "max_tokens": 1000}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        error = assert_error(await http.post("/v1/completions", json=body), 400, code="over_budget")
        assert "about 128,000 bytes" in error["message"] and "--max-response-bytes" in error["message"]
        assert (await http.post("/v1/completions", json={**body, "n": 12})).status_code == 200
    assert len(backend.submitted) == 12


def test_the_budgets_defaults_and_checks():
    limits = RequestLimits()
    assert (limits.max_request_logprobs, limits.max_response_bytes) == (1 << 20, 64 << 20)
    assert DEFAULT_MAX_RESPONSE_BYTES == limits.max_response_bytes
    for name, flag in (("max_request_logprobs", "--max-request-logprobs"), ("max_response_bytes",
                                                                            "--max-response-bytes")):
        with pytest.raises(ValueError, match=flag):
            RequestLimits(**{name: 0})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_answer_in_pieces_is_the_answer_made_whole(tokenizer, backend, path, monkeypatch):
    """The same request answered in pieces and, as a control, whole (the threshold raised): the same bytes."""
    body = {"model": MODEL, "n": 6, "prompt_logprobs": 5, "max_tokens": 8, "request_id": "same", "seed": 3,
            **({"prompt": PROMPT[:300], "logprobs": 5, "echo": True} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hi " * 80}], "logprobs": True, "top_logprobs": 5})}
    answers = []
    threshold = pieces.PIECES_ABOVE_BYTES
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        for above in (threshold, 1 << 40):
            monkeypatch.setattr("megatron_serve.server.whole_answers.PIECES_ABOVE_BYTES", above)
            answer = await http.post(path, json=body)
            assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
            answers.append(answer)
    in_pieces, made_whole = answers
    assert "content-length" not in in_pieces.headers and in_pieces.headers["transfer-encoding"] == "chunked"
    assert "content-length" in made_whole.headers  # the control took the other way
    assert len(in_pieces.content) > threshold
    assert json.loads(in_pieces.content)["choices"][5]["index"] == 5

    def same_time(data: bytes) -> bytes:
        return re.sub(rb'"created":\d+', b'"created":0', data)

    assert same_time(in_pieces.content) == same_time(made_whole.content)


async def test_a_small_request_beside_a_large_answer_keeps_its_pace(tokenizer, backend):
    """A large answer within the budget (48 choices of 1,000 scored prompt positions with 20 alternatives, 50 MB)
    is built and written while small completions run beside it: none of them waits for the whole answer to be
    made (before, it was serialized on the event loop, which answered nobody else meanwhile). The control, the same
    request answered whole, fails the bound (measured with ``PIECES_ABOVE_BYTES`` raised)."""
    large = {**AMPLIFYING, "n": 48}  # 1,023,120 log probs: within the budget
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    thresholds = gc.get_threshold()
    freeze_startup_heap()  # as the server's process is (its full collections then walk what came since)
    defer_young_collections()
    try:
        await _beside(tokenizer, backend, large, small)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


#: At most how many times the large answer is fetched beside the small completions. Serializing the whole answer on
#: the event loop stalls the small ones every time; a stall of the host's scheduler (three workers on two cores) hits
#: one fetch now and then: the bound holds for the best of the fetches, so the fetches stop at the first within it
#: (the best can only improve with more; the whole answer made on the loop never gets within it).
FETCHES = 3
#: The bound on the worst small completion's wait, as a share of the large answer's time.
WORST_SHARE = 1 / 25


async def _beside(tokenizer, backend, large: dict, small: dict) -> None:
    async with serving(make_app(tokenizer, backend)) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def small_latency() -> float:
            started = time.perf_counter()
            answer = await http.post("/v1/completions", json=small)
            assert answer.status_code == 200
            return time.perf_counter() - started

        alone = [await small_latency() for _ in range(10)]
        fetches = []
        for _ in range(FETCHES):
            received = 0
            large_started = time.perf_counter()

            async def fetch_large() -> None:
                nonlocal received
                async with http.stream("POST", "/v1/completions", json=large) as answer:
                    assert answer.status_code == 200
                    async for chunk in answer.aiter_raw():
                        received += len(chunk)

            task = asyncio.create_task(fetch_large())
            beside = []
            while not task.done():
                beside.append(await small_latency())
            await task
            assert received > 10_000_000 and len(beside) >= 3
            fetches.append((max(beside) / (time.perf_counter() - large_started), max(beside), len(beside)))
            if fetches[-1][0] < WORST_SHARE:
                break
    # The small completions ran all along the large answer, none waiting for more than a sliver of it (made whole
    # and serialized on the event loop, as before, the worst waited about a tenth of it: the serialization)
    assert min(share for share, _, _ in fetches) < WORST_SHARE, (statistics.median(alone), fetches)
