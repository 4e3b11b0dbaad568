"""The model's generation_config.json defaults reach the engine requests of both OpenAI endpoints."""

from __future__ import annotations

import httpx
import pytest

from megatron_serve.generation_config import GenerationDefaults
from megatron_serve.server import create_app

from .conftest import serving
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
DEFAULTS = GenerationDefaults({"temperature": 0.25, "top_k": 9, "top_p": 0.75, "num_tokens_to_generate": 4,
                               "min_p": 0.05, "repetition_penalty": 1.1})


async def submitted_params(tokenizer, defaults: GenerationDefaults | None, path: str, body: dict):
    backend = FakeBackend(tokenizer, max_sequence_length=1024)
    app = create_app(backend, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05,
                     generation_defaults=defaults)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        answer = await http.post(path, json={"model": MODEL, **body})
        assert answer.status_code == 200, answer.text
    (_, params), = backend.submitted
    return params


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hello"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
async def test_fields_a_request_leaves_out_take_the_models_defaults(tokenizer, path, body):
    params = await submitted_params(tokenizer, DEFAULTS, path, body)
    assert (params.temperature, params.top_k, params.top_p, params.num_tokens_to_generate) == (0.25, 9, 0.75, 4)
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.1)  # the logit controls' defaults too


async def test_what_a_request_sets_wins(tokenizer):
    body = {"prompt": "Hello", "temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_tokens": 6, "min_p": 0.0,
            "repetition_penalty": 1.0}
    params = await submitted_params(tokenizer, DEFAULTS, "/v1/completions", body)
    assert (params.temperature, params.top_k, params.top_p, params.num_tokens_to_generate) == (1.0, 0, 1.0, 6)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)


async def test_without_defaults_the_openai_defaults_apply(tokenizer):
    params = await submitted_params(tokenizer, None, "/v1/completions", {"prompt": "Hello"})
    assert (params.temperature, params.top_k, params.top_p, params.num_tokens_to_generate) == (1.0, 0, 1.0, 16)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
