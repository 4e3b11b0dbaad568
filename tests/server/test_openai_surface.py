"""The OpenAI surface a vLLM user expects, with the official ``openai`` client against a real engine.

A ``MegatronAsyncLLM`` in direct mode on the tiny random model behind the app: structured outputs
(``response_format``, ``guided_*``), tool calls (``required``, a named function, ``auto`` read by the
Hermes parser), logit controls, prompt log probs (``echo`` with ``logprobs``, ``prompt_logprobs``),
and ``/tokenize`` / ``/detokenize``.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
import transformers

from .conftest import surface

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age"], "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like?"}]


def is_person(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def test_structured_outputs_hold_for_many_seeds_and_free_text_does_not(tiny_model, tokenizer):
    """Each constraint (a JSON schema, a choice, a regex) holds for every seed; the control, the same requests
    without it, holds for none, so the constraint is what made the output fit."""
    async with surface(tiny_model, tokenizer) as (client, _):
        def chat(seed: int, **extra):
            return client.chat.completions.create(model=MODEL, messages=ASK, seed=seed, temperature=1.0,
                                                  max_tokens=150, **extra)

        def complete(prompt: str, seed: int, extra_body: dict | None = None):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=seed,
                                             extra_body=extra_body)

        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        answers = await asyncio.gather(*(chat(seed, response_format=schema) for seed in range(20)))
        assert all(answer.choices[0].finish_reason == "stop" for answer in answers)
        assert all(is_person(answer.choices[0].message.content) for answer in answers)
        assert len({answer.choices[0].message.content for answer in answers}) > 10
        free = await asyncio.gather(*(chat(seed) for seed in range(5)))
        assert not any(is_person(answer.choices[0].message.content) for answer in free)

        choices = ("alpha", "beta", "gamma ray")
        picked = await asyncio.gather(*(complete("Pick:", seed, {"guided_choice": list(choices)}) for seed in range(5)))
        assert all(answer.choices[0].text in choices for answer in picked)
        free = await asyncio.gather(*(complete("Pick:", seed) for seed in range(5)))
        assert not any(answer.choices[0].text in choices for answer in free)

        code = r"[A-Z]{3}-\d{2}"
        coded = await asyncio.gather(*(complete("Code:", seed, {"guided_regex": code}) for seed in range(5)))
        assert all(re.fullmatch(code, answer.choices[0].text) for answer in coded), [a.choices[0].text for a in coded]
        free = await asyncio.gather(*(complete("Code:", seed) for seed in range(5)))
        assert not any(re.fullmatch(code, answer.choices[0].text) for answer in free)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


async def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls put together from streamed deltas, the finish reason, and the streamed content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] = (piece.function.name if piece.function else None) or call["name"]
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


async def test_required_and_named_tool_choice_return_valid_calls(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer) as (client, _):
        for seed, parallel in ((0, True), (1, True), (2, False)):
            answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed,
                                                          tool_choice="required", temperature=1.0, max_tokens=450,
                                                          parallel_tool_calls=parallel)
            assert answer.choices[0].finish_reason == "tool_calls"
            check_calls(answer.choices[0].message.tool_calls)
            assert parallel or len(answer.choices[0].message.tool_calls) == 1
            stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed,
                                                          tool_choice="required", temperature=1.0, max_tokens=450,
                                                          parallel_tool_calls=parallel, stream=True)
            calls, finish, _ = await streamed_calls(stream)
            assert finish == "tool_calls"
            # same seed, same calls (ids aside) whole or streamed
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.function.name, c.function.arguments) for c in answer.choices[0].message.tool_calls]
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        named = {"type": "function", "function": {"name": "get_time"}}
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                      temperature=1.0, max_tokens=50)
        assert answer.choices[0].finish_reason == "stop"
        assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["get_time"]
        check_calls(answer.choices[0].message.tool_calls)
        stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                      temperature=1.0, max_tokens=50, stream=True)
        calls, _, _ = await streamed_calls(stream)
        assert [c["name"] for c in calls] == ["get_time"] and calls[0]["id"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["get_time"])


async def test_auto_tool_choice_reads_hermes_calls_and_history_renders(tiny_model, tokenizer):
    # The tiny model writes a Hermes call only when made to: the regex constraint makes it, the parser reads it.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "(Paris|Rome)", "days": [1-7]}}\n</tool_call>'
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=200,
                extra_body={"guided_regex": r"Sure\. " + call.replace("{", r"\{").replace("}", r"\}")})
    async with surface(tiny_model, tokenizer) as (client, http):
        answer = await client.chat.completions.create(**body)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls"
        assert message.content == "Sure. "
        check_calls(message.tool_calls)
        calls, finish, content = await streamed_calls(await client.chat.completions.create(**body, stream=True))
        assert finish == "tool_calls" and content == "Sure. " and calls[0]["name"] == "get_weather"
        # the call and its result go back into the conversation through the chat template
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [message.tool_calls[0].model_dump()]},
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        follow = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                      max_tokens=5, temperature=0)
        rendered = (await http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS})).json()
        assert follow.usage.prompt_tokens == rendered["count"]
        text = (await http.post("/detokenize", json={"model": MODEL, "tokens": rendered["tokens"]})).json()["prompt"]
        assert "<tool_call>" in text and '"get_weather"' in text and "sunny" in text and "<tools>" in text


async def test_logit_controls_through_the_api(tiny_model, tokenizer):
    target = tokenizer.encode(" fox", add_special_tokens=False)[0]
    async with surface(tiny_model, tokenizer) as (client, http):
        greedy = dict(model=MODEL, prompt="The quick brown", max_tokens=12, temperature=0, logprobs=0,
                      extra_body={"ignore_eos": True})
        plain = await client.completions.create(**greedy)
        neutral = await client.completions.create(**{**greedy, "extra_body": {
            "ignore_eos": True, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": []}},
            presence_penalty=0.0, frequency_penalty=0.0, logit_bias={})
        assert neutral.choices[0].text == plain.choices[0].text
        assert neutral.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
        biased = await client.completions.create(**greedy, logit_bias={str(target): 100})
        assert biased.choices[0].logprobs.tokens == [tokenizer.token_text(target)] * 12
        sampled = await client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=8, temperature=1,
                                                  seed=5, logit_bias={str(target): 100})
        assert sampled.choices[0].text == tokenizer.token_text(target) * 8
        ids = (await http.post("/v1/completions", json={
            "model": MODEL, "prompt": "The quick brown", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "presence_penalty": 2.0, "return_epochs": True})).json()
        assert ids["usage"]["completion_tokens"] == 30


async def test_prompt_log_probs_match_transformers_with_and_without_a_cache_hit(tiny_model, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    tokens = tokenizer.encode(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    expected = log_probs[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    async with surface(tiny_model, tokenizer, enable_prefix_caching=True) as (client, http):
        warm = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # this prompt is in the cache
        echoed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                                 logprobs=2)
        lp = echoed.choices[0].logprobs
        assert echoed.choices[0].text.startswith(prompt)
        assert lp.tokens[: len(tokens)] == [tokenizer.token_text(t) for t in tokens]
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(tokens) + 3
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1: len(tokens)]), expected, atol=1e-4, rtol=0)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the token and its 2 best (vLLM), keyed by text
        scored = (await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                           "temperature": 0, "prompt_logprobs": 1})).json()
        entries = scored["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(tokens)
        got = [entries[i + 1][str(tokens[i + 1])]["logprob"] for i in range(len(tokens) - 1)]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=0)
        best = log_probs[:-1].argmax(-1).tolist()
        bad = [(i, entries[i + 1], best[i]) for i in range(len(tokens) - 1) if entries[i + 1].get(str(best[i]), {}).get("rank") != 1]
        assert not bad, bad[:3]
        chat = (await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1,
                                                              "prompt_logprobs": 0})).json()
        assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
        assert "prompt_logprobs" not in warm.model_dump(exclude_unset=True)["choices"][0]


async def test_tokenize_and_detokenize_in_vllms_shapes(tiny_model, tokenizer):
    async with surface(tiny_model, tokenizer) as (_, http):
        body = (await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                   "return_token_strs": True})).json()
        assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 1024 and "".join(body["token_strs"]).endswith("Hello world")
        plain = (await http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})).json()
        assert plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
        assert plain["token_strs"] is None
        back = (await http.post("/detokenize", json={"model": MODEL, "tokens": plain["tokens"]})).json()
        assert back == {"prompt": "Hello world"}
        bad = await http.post("/detokenize", json={"model": MODEL, "tokens": [600]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert (await http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})).status_code == 404
