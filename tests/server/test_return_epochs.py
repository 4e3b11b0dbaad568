"""The ``return_epochs`` extension and the refit series of ``/metrics``, over a real (direct-mode) engine.

A ``MegatronAsyncLLM`` in direct mode behind the app: choices carry ``policy_epochs`` and
``kv_epochs`` only when asked, whole and streamed (on the choice's last chunk), for completions
and chat; after a refit they show the new epoch, and ``/metrics`` reports the epoch and how long
the refit took.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve import MegatronAsyncLLM
from megatron_serve.server import create_app
from megatron_serve.model.tiny import make_tiny_model

from .conftest import metric, serving

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama"
TOKENS = 5


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("epochs") / "b", seed=1))


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, **extra}


def last_chunks(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


async def test_return_epochs_before_and_after_a_refit(tiny_model, tokenizer, second_checkpoint):
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024,
                         status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            plain = (await http.post("/v1/completions", json=completion())).json()
            assert not {"policy_epochs", "kv_epochs", "lora_epochs"} & set(plain["choices"][0])

            asked = (await http.post("/v1/completions", json=completion(return_epochs=True, n=2))).json()
            for choice in asked["choices"]:
                assert choice["policy_epochs"] == choice["kv_epochs"] == [0] * TOKENS
                assert choice["lora_epochs"] == [-1] * TOKENS  # the base model: no adapter version

            bad = await http.post("/v1/completions", json=completion(return_epochs="yes"))
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_epochs"

            await llm.refit(second_checkpoint, epoch=4)
            after = (await http.post("/v1/chat/completions", json=chat(return_epochs=True))).json()
            assert after["choices"][0]["policy_epochs"] == after["choices"][0]["kv_epochs"] == [4] * TOKENS

            streamed = await http.post("/v1/completions", json=completion(return_epochs=True, stream=True))
            chunks = last_chunks(streamed.text)
            final = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
            assert len(final) == 1 and final[0]["policy_epochs"] == [4] * TOKENS
            assert all("policy_epochs" not in c["choices"][0] for c in chunks
                       if c["choices"] and not c["choices"][0].get("finish_reason"))
            chat_chunks = last_chunks((await http.post("/v1/chat/completions",
                                                       json=chat(return_epochs=True, stream=True))).text)
            ends = [c["choices"][0] for c in chat_chunks if c["choices"] and c["choices"][0].get("finish_reason")]
            assert len(ends) == 1 and ends[0]["kv_epochs"] == [4] * TOKENS

            deadline = asyncio.get_running_loop().time() + 10  # the status poll runs every 0.05 s
            while True:
                text = (await http.get("/metrics")).text
                if metric(text, "megatron_serve_weights_epoch") == 4.0 or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.02)
            assert metric(text, "megatron_serve_weights_epoch") == 4.0
            assert metric(text, "megatron_serve_refits_total") == 1.0
            assert metric(text, "megatron_serve_engine_weights_epoch", 'engine="local",group="0"') == 4.0
            total = metric(text, "megatron_serve_engine_refit_seconds", 'engine="local",group="0",phase="total"')
            load = metric(text, "megatron_serve_engine_refit_seconds", 'engine="local",group="0",phase="load"')
            assert total >= load > 0
