"""A multi-turn, tool-using rollout on the real model, as SkyRL and prime-rl run one: each turn's prompt is
``POST /v1/chat/completions/render`` of the whole conversation with the model's own chat template, and the engine runs it
through ``POST /inference/v1/generate``, tokens in and tokens out. SmolLM2's template has no tool-call format (so no
``tools`` are sent: the chat route would refuse ``tool_choice`` ``auto``); the tools' results come back as ``tool``
messages, which it renders as turns of their own.

The trainer's rule: a turn's prompt ids start with the previous turn's prompt ids and completion ids exactly, so that
the sequence the policy is trained on is the one it generated (no retokenization drift). That holds only because the
completion ends with the end-of-turn token it sampled (``<|im_end|>``, SmolLM2's EOS), which the template renders
after an assistant's turn, and because the text handed back as the assistant's message leaves it out. The controls:
the completion's last id is that token (the engine dropped it before), and what the next prompt adds after the
completion opens the next message (without the token it would start with ``<|im_end|>``).
"""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.model.hub import resolve_model
from megatron_serve.server import create_app
from megatron_serve.tokenizer import Tokenizer

from ..server.conftest import serving

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2"
TURN_TOKENS = 64


@pytest.fixture
async def http(llm, smollm2) -> AsyncIterator[tuple[httpx.AsyncClient, Tokenizer]]:
    """The HTTP app over an engine on the session's model (its weights shared, a KV pool of its own)."""
    tokenizer = Tokenizer.from_pretrained(resolve_model(smollm2))
    settings = InferenceConfig(block_size_tokens=16, num_kv_blocks=64)
    async with MegatronAsyncLLM(llm.engine.model, settings, tokenizer=tokenizer) as served:
        app = create_app(served.client, tokenizer, MODEL, vocab_size=tokenizer.vocab_size, max_model_len=1024)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as client:
            yield client, tokenizer


async def render(http: httpx.AsyncClient, messages: list[dict]) -> list[int]:
    """The ids the chat route runs for ``messages``, the assistant's turn opened."""
    answer = await http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
    assert answer.status_code == 200, answer.text
    return answer.json()["token_ids"]


async def test_three_turns_with_a_tool_each_extend_the_last_prompt_and_completion_exactly(http):
    client, tokenizer = http
    end_of_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in tokenizer.eos_token_ids
    messages = [{"role": "system", "content": "You are a weather assistant. Answer in one short sentence."},
                {"role": "user", "content": "Is it sunny in Paris today?"}]
    followers = [{"role": "tool", "content": "Paris: sunny, 24 C"},
                 {"role": "tool", "content": "Oslo: rain, 9 C"},
                 {"role": "user", "content": "Thanks. Which city is warmer?"}]
    prompt = await render(client, messages)
    for turn, follower in enumerate(followers):
        answer = await client.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
            "max_tokens": TURN_TOKENS, "temperature": 0, "logprobs": 0}})
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        completion = choice["token_ids"]
        text = tokenizer.decode(completion, skip_special_tokens=True)
        # the sampled end of turn is the last id, counted and scored, and not in the text
        assert choice["finish_reason"] == "stop" and completion[-1] == end_of_turn[0], (turn, text)
        assert end_of_turn[0] not in completion[:-1]
        assert answer.json()["usage"]["completion_tokens"] == len(completion)
        assert len(choice["logprobs"]["content"]) == len(completion)
        assert "<|im_end|>" not in text and text.strip()

        messages = [*messages, {"role": "assistant", "content": text}, follower]
        following = await render(client, messages)
        assert following[:len(prompt) + len(completion)] == prompt + completion, (turn, text)
        # what the new turn adds opens the next message: the end of the assistant's turn is the completion's own
        rest = tokenizer.decode(following[len(prompt) + len(completion):], skip_special_tokens=False)
        assert rest.startswith(f"\n<|im_start|>{follower['role']}\n{follower['content']}<|im_end|>"), rest
        prompt = following
