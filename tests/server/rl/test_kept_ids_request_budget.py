"""slime's top-p kept ids (SGLang's ``custom_params.return_top_p_token_ids``) counted as produced, per request, through
the HTTP server over a real engine in this process (direct mode, no coordinator).

* **Per request, over its choices**: ``n`` 2 at temperature 1.5 / top_p 0.99 keeps the same 4,048 ids on each
  choice here (8 tokens of a 512-id vocabulary, one seed). Under a ``--max-request-logprobs`` one short of their sum,
  which each choice's ids fit, the request ends: 400 ``over_budget`` whole, an error event streamed, the message
  naming the budget and the two choices. At their sum (the control) it is served. Counted per choice, as before,
  both were served.
* **Answer bytes**: the same ids charged against ``--max-response-bytes`` as they are produced, beside the tokens'
  up-front estimate: one id of room short ends the request naming that budget; at the room they need it is served.
* **Direct mode answers as the coordinator does**: the in-process engine's own bound (``MegatronAsyncLLM``'s
  ``max_request_logprobs``) ends the request as a coordinator ends one (FAILED, reason ``length``), which the server
  answers 400 ``over_budget`` with the figures, as through a fleet (tests/server/rl/test_kept_ids_fleet.py); it was
  a ``ValueError`` before, answered ``invalid_request``.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.limits import KEPT_ID_BYTES, RequestLimits, engine_request_cost
from megatron_serve.server import create_app
from megatron_serve.tokenizer import Tokenizer
from megatron_serve.wire.sampling_params import SamplingParams

from ..conftest import serving
from .tokens_app import error_of

pytestmark = pytest.mark.timeout(300)

TOKENS = 8
WIDE = {"temperature": 1.5, "top_p": 0.99, "sampling_seed": 3, "max_new_tokens": TOKENS, "ignore_eos": True,
        "custom_params": {"return_top_p_token_ids": True}}
PROMPT = [5, 6, 7, 8]
CONFIG = InferenceConfig(dtype="float32", block_size_tokens=16, num_kv_blocks=64)


@contextlib.asynccontextmanager
async def _served(llm: MegatronAsyncLLM, tokenizer: Tokenizer, limits: RequestLimits | None = None
                  ) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(llm.client, tokenizer, "tiny-llama", vocab_size=512, max_model_len=1024, status_interval=0.05,
                     limits=limits)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        yield http


async def _generate(http: httpx.AsyncClient, n: int = 1, stream: bool = False) -> httpx.Response:
    return await http.post("/generate", json={"input_ids": PROMPT, "stream": stream,
                                              "sampling_params": {**WIDE, "n": n}})


def _kept_each(answer: httpx.Response) -> list[int]:
    """The kept ids of each sequence of a served answer."""
    assert answer.status_code == 200, answer.text
    body = answer.json()
    sequences = body if isinstance(body, list) else [body]
    return [int(np.frombuffer(base64.b64decode(s["meta_info"]["top_p_token_offsets"]), "<i4")[-1]) for s in sequences]


def _last_event(answer: httpx.Response) -> dict[str, Any]:
    data = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", answer.text[-500:]
    return json.loads(data[-2])


async def test_two_choices_share_the_request_budget_for_their_kept_ids(tiny_model, tokenizer):
    async with MegatronAsyncLLM(tiny_model, CONFIG) as llm:
        async with _served(llm, tokenizer) as http:
            each = _kept_each(await _generate(http, n=2))
        total = sum(each)
        assert len(each) == 2 and max(each) <= total - 1  # one short of the sum: each choice alone fits
        async with _served(llm, tokenizer, RequestLimits(max_request_logprobs=total - 1)) as http:
            error = error_of(await _generate(http, n=2))
            assert error["code"] == "over_budget", error
            assert f"budget of {total - 1:,} per request (--max-request-logprobs)" in error["message"], error
            assert "of its 2 choices" in error["message"] and "was ended" in error["message"], error
            streamed = _last_event(await _generate(http, n=2, stream=True))
            assert "of its 2 choices" in json.dumps(streamed), streamed  # the stream's final event: the error
        async with _served(llm, tokenizer, RequestLimits(max_request_logprobs=total)) as http:
            assert _kept_each(await _generate(http, n=2)) == each  # the control: at the sum, served


async def test_kept_ids_count_against_the_answer_bytes_as_they_are_produced(tiny_model, tokenizer):
    async with MegatronAsyncLLM(tiny_model, CONFIG) as llm:
        async with _served(llm, tokenizer) as http:
            (kept,) = _kept_each(await _generate(http))
        tokens_bytes = engine_request_cost(len(PROMPT), SamplingParams(num_tokens_to_generate=TOKENS)).answer_bytes
        short = tokens_bytes + (kept - 1) * KEPT_ID_BYTES
        async with _served(llm, tokenizer, RequestLimits(max_response_bytes=short)) as http:
            error = error_of(await _generate(http))
            assert error["code"] == "over_budget", error
            assert f"budget of {short:,} bytes per answer (--max-response-bytes)" in error["message"], error
            assert f"{kept:,} top-p token ids in {TOKENS} new tokens" in error["message"], error
        async with _served(llm, tokenizer, RequestLimits(max_response_bytes=short + KEPT_ID_BYTES)) as http:
            assert _kept_each(await _generate(http)) == [kept]  # the control: room for every id, served


async def test_the_in_process_engines_own_bound_is_answered_as_a_fleets(tiny_model, tokenizer):
    async with MegatronAsyncLLM(tiny_model, CONFIG) as llm:
        async with _served(llm, tokenizer) as http:
            (kept,) = _kept_each(await _generate(http))
    async with MegatronAsyncLLM(tiny_model, CONFIG, max_request_logprobs=kept - 1) as llm:
        async with _served(llm, tokenizer) as http:  # the server's own budget: its default, far above
            error = error_of(await _generate(http))
            assert error["code"] == "over_budget", error  # invalid_request before
            assert f"budget of {kept - 1:,} per request (max_request_logprobs)" in error["message"], error
            assert f"{kept:,} top-p token ids in {TOKENS} new tokens" in error["message"], error
            assert "was ended" in error["message"], error
            assert _kept_each(await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
                **WIDE, "temperature": 0.0}})) == [TOKENS]  # the engine serves the next request (greedy: one each)
