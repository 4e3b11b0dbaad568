"""A multi-turn, tool-using rollout the way SkyRL and prime-rl run one: ``render`` once, then tokens in and tokens out.

The first prompt comes from ``POST /v1/chat/completions/render`` (the ids ``/v1/chat/completions`` runs for the
conversation and its tools); every later prompt is the previous prompt, the ids the engine generated, the end of the
assistant's turn and the tool's turn (rendered once, as a delta), never the conversation tokenized again. So each
turn's prompt extends the previous prompt and completion exactly, and the engine runs exactly those ids: checked
``==`` against ``/v1/completions`` given the same ids. The chat template is Qwen2.5's (``qwen2_5_chat_template.jinja``,
hermes-style tool calls), on the tiny model's ChatML vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from megatron_serve.tokenizer import Tokenizer

from ..conftest import surface
from .tokens_app import MODEL

pytestmark = pytest.mark.timeout(300)

TEMPLATE = Path(__file__).with_name("qwen2_5_chat_template.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ["Paris", "Lima", "Oslo"]
TURN_TOKENS = 6


async def render(http: httpx.AsyncClient, messages: list[dict], opened: bool = True) -> list[int]:
    """The ids the chat route runs for ``messages`` (``opened``: with the assistant's turn opened)."""
    answer = await http.post("/v1/chat/completions/render", json={
        "model": MODEL, "messages": messages, "tools": TOOLS, "add_generation_prompt": opened})
    assert answer.status_code == 200, answer.text
    return answer.json()["token_ids"]


async def tool_turn(http: httpx.AsyncClient, messages: list[dict], call: dict, result: str) -> list[int]:
    """The ids of the tool's turn and the next assistant opening, after an assistant turn that made ``call``: the
    conversation rendered with and without it (the rest of the prompt is never rendered again)."""
    asked = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]}]
    before = await render(http, asked, opened=False)
    after = await render(http, [*asked, {"role": "tool", "tool_call_id": call["id"], "content": result}])
    assert after[:len(before)] == before  # the template only appends
    return after[len(before):]


async def test_each_turn_extends_the_last_prompt_and_completion_exactly(tiny_model):
    tokenizer = Tokenizer.from_pretrained(tiny_model, chat_template=TEMPLATE.read_text())
    messages = [{"role": "system", "content": "Answer with the weather."},
                {"role": "user", "content": "What is the weather in Paris, Lima and Oslo?"}]
    async with surface(tiny_model, tokenizer) as (_, http):
        prompt = await render(http, messages)
        chat = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True})).json()
        assert prompt == chat["prompt_token_ids"]  # render and the chat route: one code path
        end_of_turn = (await http.post("/tokenize", json={"model": MODEL, "prompt": "<|im_end|>\n",
                                                          "add_special_tokens": False})).json()["tokens"]
        assert end_of_turn[0] == tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]

        for turn, city in enumerate(CITIES):
            answer = (await http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
                "max_tokens": TURN_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}})).json()
            (choice,) = answer["choices"]
            completion = choice["token_ids"]
            assert answer["usage"]["prompt_tokens"] == len(prompt) and len(completion) == TURN_TOKENS
            assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in completion]
            ran = (await http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": TURN_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})).json()["choices"][0]
            assert ran["prompt_token_ids"] == prompt and ran["token_ids"] == completion  # exactly these ids ran

            call = {"id": f"call-{turn}", "type": "function",
                    "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
            following = await tool_turn(http, messages, call, f"{city}: sunny")
            next_prompt = prompt + completion + end_of_turn + following
            assert next_prompt[:len(prompt) + len(completion)] == prompt + completion
            assert tokenizer.decode(following, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": f"{city}: sunny"}]
            prompt = next_prompt
