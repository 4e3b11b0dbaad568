"""The ``return_routing_indices`` extension over HTTP, on a real (direct-mode) engine serving a tiny MoE model.

Choices carry ``routing_indices`` only when asked: whole answers on the choice, streamed answers on
the choice's last chunk only, for completions and chat. The rows are the engine's own (the same
model run through ``MegatronLLM`` gives the same lists); a dense model answers 400.
"""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM, MegatronLLM, SamplingParams
from megatron_serve.server import create_app
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from .conftest import serving

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-moe"
TOKENS = 5
CONFIG = InferenceConfig(dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("http-moe") / MODEL, seed=0, arch="mixtral"))


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}


def events(text: str) -> list[dict]:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


async def test_routing_indices_only_when_asked_whole_and_streamed(moe_model):
    tokenizer = Tokenizer.from_pretrained(moe_model)
    prompt = tokenizer.encode("Hello there")
    expected = MegatronLLM(moe_model, CONFIG).generate([prompt], SamplingParams(
        temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True, return_routing_indices=True))[0]
    rows = expected.routing_indices.tolist()
    assert len(rows) == len(prompt) + TOKENS - 1 and len(rows[0]) == 2 and len(rows[0][0]) == 2  # layers, top-2

    async with MegatronAsyncLLM(moe_model, CONFIG) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024,
                         status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            plain = (await http.post("/v1/completions", json=completion())).json()
            assert "routing_indices" not in plain["choices"][0]

            asked = (await http.post("/v1/completions", json=completion(return_routing_indices=True, n=2))).json()
            assert [c["routing_indices"] for c in asked["choices"]] == [rows, rows]

            streamed = events((await http.post("/v1/completions",
                                               json=completion(return_routing_indices=True, stream=True))).text)
            carrying = [c["choices"][0] for c in streamed if c["choices"] and "routing_indices" in c["choices"][0]]
            assert len(carrying) == 1 and carrying[0]["finish_reason"] == "length"
            assert carrying[0]["routing_indices"] == rows

            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_routing_indices": True}
            answer = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]
            chat_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}], add_generation_prompt=True), add_special_tokens=False))
            assert len(answer["routing_indices"]) == chat_prompt + TOKENS - 1
            chunks = events((await http.post("/v1/chat/completions", json={**chat, "stream": True})).text)
            ends = [c["choices"][0] for c in chunks if c["choices"] and "routing_indices" in c["choices"][0]]
            assert len(ends) == 1 and ends[0]["routing_indices"] == answer["routing_indices"]

            bad = await http.post("/v1/completions", json=completion(return_routing_indices="yes"))
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_routing_indices"


async def test_dense_model_answers_400(tiny_model, tokenizer):
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, "tiny-llama", vocab_size=512, max_model_len=1024)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            response = await http.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": "Hello", "max_tokens": 2, "return_routing_indices": True})
    assert response.status_code == 400
    assert "mixture-of-experts" in response.json()["error"]["message"]
