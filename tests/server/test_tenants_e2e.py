"""Tenants end to end through real HTTP over a real engine (docs/tenants.md): with every slot streaming a
sheddable tenant's answer, a critical tenant's request is answered while they still stream (it preempts one), and
every answer, the preempted one's included, is the text of an uninterrupted run (greedy)."""

from __future__ import annotations

import asyncio
import json

import pytest

from .conftest import surface

pytestmark = pytest.mark.timeout(300)

DOCUMENT = json.dumps({"tenants": {"bulk": {"class": "sheddable"}, "chat": {"class": "critical"}},
                       "keys": [{"key": "key-bulk", "tenant": "bulk"}, {"key": "key-chat", "tenant": "chat"}]})
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning there was"]


def body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


async def test_a_critical_request_is_answered_while_every_slot_streams_sheddable_ones(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer, {"api_key": DOCUMENT}, max_requests=2) as (_, http):
        bulk, chat = {"Authorization": "Bearer key-bulk"}, {"Authorization": "Bearer key-chat"}
        alone = []
        for prompt, tokens in ((PROMPTS[0], 160), (PROMPTS[1], 160), (PROMPTS[2], 8)):
            answer = await http.post("/v1/completions", json=body(prompt, tokens), headers=chat)
            alone.append(answer.json()["choices"][0]["text"])
        streamed: dict[int, list[str]] = {0: [], 1: []}
        started = {0: asyncio.Event(), 1: asyncio.Event()}

        async def stream(index: int) -> str:
            async with http.stream("POST", "/v1/completions", json=body(PROMPTS[index], 160, stream=True),
                                   headers=bulk) as answer:
                assert answer.status_code == 200
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        streamed[index].append(json.loads(line[6:])["choices"][0]["text"])
                        started[index].set()
            return "".join(streamed[index])

        streams = [asyncio.ensure_future(stream(i)) for i in (0, 1)]
        await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), 120)
        critical = await http.post("/v1/completions", json=body(PROMPTS[2], 8), headers=chat)
        assert critical.status_code == 200
        assert not all(s.done() for s in streams)  # answered while the sheddable ones still stream
        texts = await asyncio.gather(*streams)
        assert [*texts, critical.json()["choices"][0]["text"]] == alone
        metrics = (await http.get("/metrics")).text
    assert 'megatron_serve_tenant_num_preemptions_total{priority_class="sheddable",tenant="bulk"} 1.0' in metrics
