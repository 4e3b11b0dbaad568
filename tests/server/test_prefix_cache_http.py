"""``usage.prompt_tokens_details.cached_tokens`` and the prefix-cache series of ``/metrics``, over a real engine.

A ``MegatronAsyncLLM`` in direct mode (prefix caching on, blocks of 16 tokens) behind the app: a
repeated long prompt reports the tokens its KV blocks were reused for, whole and streamed, for
completions and chat, counted once per prompt when ``n > 1``; the counters of ``/metrics`` move.
"""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.server import create_app

from .conftest import metric, serving

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
BLOCK = 16
PROMPT = [5 + (i * 37) % 480 for i in range(100)]  # 6 complete blocks and 4 tokens
CACHED = (len(PROMPT) - 1) // BLOCK * BLOCK  # the engine always computes the last prompt token


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra}


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


async def metrics(http: httpx.AsyncClient) -> str:
    return (await http.get("/metrics")).text


async def test_cached_tokens_in_usage_and_metrics(tiny_model, tokenizer):
    config = InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=128, enable_prefix_caching=True)
    async with MegatronAsyncLLM(tiny_model, config) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024,
                         status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = await metrics(http)
            assert metric(before, "megatron_serve_cached_prompt_tokens_total") == 0
            assert metric(before, "megatron_serve_prefix_cache_hit_rate") == 0

            first = (await http.post("/v1/completions", json=completion())).json()
            assert first["usage"]["prompt_tokens"] == len(PROMPT) and cached(first["usage"]) == 0
            second = (await http.post("/v1/completions", json=completion())).json()
            assert cached(second["usage"]) == CACHED
            assert second["choices"][0]["text"] == first["choices"][0]["text"]

            # n > 1: the prompt counts once (its first choice's count), like prompt_tokens.
            both = (await http.post("/v1/completions", json=completion(n=2))).json()
            assert both["usage"]["prompt_tokens"] == len(PROMPT) and cached(both["usage"]) == CACHED
            # Two prompts: each counts once.
            two = (await http.post("/v1/completions", json=completion(prompt=[PROMPT, PROMPT[:40]]))).json()
            assert cached(two["usage"]) == CACHED + 32

            streamed = await http.post("/v1/completions", json=completion(
                stream=True, stream_options={"include_usage": True}))
            chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert cached(chunks[-1]["usage"]) == CACHED and chunks[-1]["choices"] == []

            text = " ".join(f"word{i}" for i in range(60))
            chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
                    "temperature": 0}
            cold = (await http.post("/v1/chat/completions", json=chat)).json()
            warm = (await http.post("/v1/chat/completions", json=chat)).json()
            prompt_tokens = warm["usage"]["prompt_tokens"]
            assert cached(cold["usage"]) == 0 and prompt_tokens > BLOCK
            assert cached(warm["usage"]) == (prompt_tokens - 1) // BLOCK * BLOCK
            chat_stream = await http.post("/v1/chat/completions", json={
                **chat, "stream": True, "stream_options": {"include_usage": True}})
            usage_chunk = [json.loads(line[len("data: "):]) for line in chat_stream.text.splitlines()
                           if line.startswith("data: ") and line != "data: [DONE]"][-1]
            assert cached(usage_chunk["usage"]) == cached(warm["usage"])

            # Per engine request: 1 + 1 + 2 (n=2) + 2 prompts + 1 streamed completion, 3 chats.
            engine_cached = 0 + CACHED + 2 * CACHED + CACHED + 32 + CACHED + 2 * cached(warm["usage"])
            after = await metrics(http)
            assert metric(after, "megatron_serve_cached_prompt_tokens_total") == engine_cached
            engine = f'engine_group="0",model_name="{MODEL}"'  # the engine's own counters, read at scrape time
            prompt_total = metric(after, "megatron_serve_prompt_tokens_total", engine)
            assert metric(after, "megatron_serve_prefix_cache_hit_rate") == pytest.approx(engine_cached / prompt_total)
            assert metric(after, "megatron_serve_prefix_cache_hits_total", engine) == engine_cached
            assert metric(after, "megatron_serve_prefix_cache_queries_total", engine) >= prompt_total
            assert metric(after, "megatron_serve_engine_computed_tokens") > 0
