"""vLLM's request fields, sent as a vLLM user sends them (the official ``openai`` client's ``extra_body``),
each checked for its effect on a real engine, not just for a 200.

A ``MegatronAsyncLLM`` in direct mode on the tiny random model behind the app, as in
``test_openai_surface.py``. Before this work every field here was a 400 ("not supported").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from typing import AsyncIterator

import httpx
import openai
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.http_options import HTTPOptions
from megatron_serve.limits import RequestLimits
from megatron_serve.server import create_app
from megatron_serve.tokenizer import Tokenizer

from .conftest import serving

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PROMPT = "A paged cache splits memory into blocks of a fixed number of tokens, the way an operating system splits"
ASK = [{"role": "user", "content": "What is the weather like?"}]
# A template that reads a variable only chat_template_kwargs can set (as Qwen3's enable_thinking)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think></think>"
            "{% endif %}{% endif %}")


@contextlib.asynccontextmanager
async def vllm_surface(tiny_model: str, tokenizer: Tokenizer, options: HTTPOptions | None = None,
                       limits: RequestLimits | None = None, **config) -> AsyncIterator[
        tuple[openai.AsyncOpenAI, httpx.AsyncClient, MegatronAsyncLLM]]:
    settings = InferenceConfig(**{"block_size_tokens": 16, "num_kv_blocks": 256, **config})
    async with MegatronAsyncLLM(tiny_model, settings) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05,
                         options=options, limits=limits)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            try:
                yield client, http, llm
            finally:
                await client.close()


def encode(tokenizer: Tokenizer, text: str, special: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=special)


def with_bos(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer, adding BOS when asked for special tokens (as Llama's do; the tiny one adds none)."""
    from tokenizers.processors import TemplateProcessing  # noqa: PLC0415

    hf = tokenizer.hf_tokenizer
    hf.backend_tokenizer.post_processor = TemplateProcessing(single=f"{hf.bos_token} $A",
                                                             special_tokens=[(hf.bos_token, hf.bos_token_id)])
    assert len(encode(tokenizer, "hi")) == len(encode(tokenizer, "hi", special=False)) + 1
    return tokenizer


async def test_truncate_prompt_tokens_gives_the_tokens_of_the_truncated_prompt(tiny_model, tokenizer):
    tail = encode(tokenizer, PROMPT)[-7:]
    greedy = dict(model=MODEL, max_tokens=8, temperature=0)
    async with vllm_surface(tiny_model, tokenizer) as (client, _, _):
        cut = await client.completions.create(prompt=PROMPT, **greedy, extra_body={"truncate_prompt_tokens": 7})
        direct = await client.completions.create(prompt=tail, **greedy)
        assert cut.usage.prompt_tokens == 7 and cut.choices[0].text == direct.choices[0].text
        whole = await client.completions.create(prompt=PROMPT, **greedy)
        assert whole.usage.prompt_tokens == len(encode(tokenizer, PROMPT)) > 7
        echoed = await client.completions.create(prompt=PROMPT, **greedy, echo=True,
                                                 extra_body={"truncate_prompt_tokens": 7})
        assert echoed.choices[0].text == tokenizer.decode(tail) + direct.choices[0].text  # echo shows what was kept
        chat = await client.chat.completions.create(messages=ASK, **greedy, extra_body={"truncate_prompt_tokens": 5})
        rendered = encode(tokenizer, tokenizer.apply_chat_template(ASK), special=False)
        chat_direct = await client.completions.create(prompt=rendered[-5:], **greedy)
        assert chat.usage.prompt_tokens == 5 and chat.choices[0].message.content == chat_direct.choices[0].text
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            await client.completions.create(prompt=PROMPT, **greedy, extra_body={"truncate_prompt_tokens": 5000})


async def test_cache_salt_isolates_prefix_cache_entries(tiny_model, tokenizer):
    body = dict(model=MODEL, prompt=PROMPT * 2, max_tokens=2, temperature=0)

    async def cached(salt: str | None) -> int:
        answer = await client.completions.create(**body, extra_body={} if salt is None else {"cache_salt": salt})
        return answer.usage.prompt_tokens_details.cached_tokens

    async with vllm_surface(tiny_model, tokenizer, enable_prefix_caching=True) as (client, _, _):
        assert await cached("tenant-a") == 0
        assert await cached("tenant-a") >= 16  # the same salt shares its blocks
        assert await cached("tenant-b") == 0  # another salt does not
        assert await cached(None) == 0  # nor does a request without one
        assert await cached(None) >= 16
        assert await cached("tenant-b") >= 16


async def test_priority_orders_admission_when_the_batch_is_full(tiny_model, tokenizer):
    """One request at a time: a long one runs, B (priority 5) queues, then C (priority -5); when the long one
    goes, C is admitted first. Without priorities the same arrivals run B first."""
    async with vllm_surface(tiny_model, tokenizer, max_requests=1) as (client, http, llm):
        async def waiting() -> int:
            return (await llm.client.status())["engines"][0]["waiting"]

        async def order(priorities: dict[str, int | None]) -> list[str]:
            finished: list[str] = []

            async def complete(name: str) -> None:
                extra = {} if priorities[name] is None else {"priority": priorities[name]}
                await client.completions.create(model=MODEL, prompt=f"Request {name}", max_tokens=2, temperature=0,
                                                extra_body=extra)
                finished.append(name)

            long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=long) as stream:
                lines = stream.aiter_lines()  # kept: a closed iterator would close the stream, ending the request
                while not (await anext(lines)).startswith("data: "):
                    pass  # the first chunk came: the long request runs, the batch is full
                tasks = []
                for name in priorities:
                    tasks.append(asyncio.create_task(complete(name)))
                    count = len(tasks)
                    deadline = asyncio.get_running_loop().time() + 60
                    while await waiting() < count:  # queued in the engine before the next one is sent
                        assert asyncio.get_running_loop().time() < deadline, f"{name} never queued"
                        await asyncio.sleep(0.02)
            # leaving the stream aborts the long request: its slot goes to the queue's head
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return finished

        assert await order({"B": 5, "C": -5}) == ["C", "B"]
        assert await order({"B": None, "C": None}) == ["B", "C"]
        assert await order({"B": "9", "C": 1}) == ["C", "B"]  # a number as a string is a number


async def test_chat_template_kwargs_and_rendering_fields_reach_the_template(tiny_model):
    tokenizer = with_bos(Tokenizer.from_pretrained(tiny_model, chat_template=TEMPLATE))
    greedy = dict(model=MODEL, max_tokens=2, temperature=0)

    def rendered(messages, **kwargs) -> int:
        return len(encode(tokenizer, tokenizer.apply_chat_template(messages, **kwargs), special=False))

    async with vllm_surface(tiny_model, tokenizer) as (client, _, _):
        plain = await client.chat.completions.create(messages=ASK, **greedy)
        thinking = await client.chat.completions.create(messages=ASK, **greedy,
                                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert plain.usage.prompt_tokens == rendered(ASK) and thinking.usage.prompt_tokens == rendered(
            ASK, enable_thinking=True) < plain.usage.prompt_tokens  # the variable changed the prompt
        bare = await client.chat.completions.create(messages=ASK, **greedy,
                                                    extra_body={"add_generation_prompt": False})
        assert bare.usage.prompt_tokens == rendered(ASK, add_generation_prompt=False)
        started = ASK + [{"role": "assistant", "content": "It is"}]
        continued = await client.chat.completions.create(messages=started, **greedy, extra_body={
            "add_generation_prompt": False, "continue_final_message": True})
        assert continued.usage.prompt_tokens == rendered(started, add_generation_prompt=False,
                                                         continue_final_message=True)
        bos = await client.chat.completions.create(messages=ASK, **greedy, extra_body={"add_special_tokens": True})
        assert bos.usage.prompt_tokens == plain.usage.prompt_tokens + 1  # the tokenizer's BOS on top
        bare_prompt = await client.completions.create(prompt=PROMPT, **greedy, extra_body={"add_special_tokens": False})
        assert bare_prompt.usage.prompt_tokens == len(encode(tokenizer, PROMPT)) - 1
        for extra, param in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
                             ({"continue_final_message": True}, "continue_final_message")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(messages=started, **greedy, extra_body=extra)
            assert refused.value.body["param"] == param


async def test_request_id_names_the_response_and_the_log(tiny_model, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="megatron_serve.requests")
    options = HTTPOptions(log_requests=True, max_log_len=12)
    async with vllm_surface(tiny_model, tokenizer, options) as (client, http, _):
        answer = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                 extra_body={"request_id": "job-42", "cache_salt": "s3cret-salt"})
        assert answer.id == "cmpl-job-42"
        chat = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                                    extra_headers={"X-Request-Id": "from-header"},
                                                    extra_body={"request_id": "from-body"})
        assert chat.id == "chatcmpl-from-header"  # the header wins, as in vLLM
        bad = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                              headers={"X-Request-Id": "line\tbreak"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
        bad = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "request_id": "a\nb"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_serve.requests"]
    received = [line for line in lines if line.startswith("request cmpl-job-42 received")]
    assert received and repr(PROMPT[:12] + "...") in received[0] and "s3cret" not in "\n".join(lines)
    assert any(line.startswith("request cmpl-job-42 finished") for line in lines)
    assert any(line.startswith("request chatcmpl-from-header received") for line in lines)


async def test_structured_outputs_is_the_guided_family(tiny_model, tokenizer):
    choices = ["alpha", "beta", "gamma ray"]
    async with vllm_surface(tiny_model, tokenizer) as (client, _, _):
        for seed in range(3):
            picked = await client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0,
                                                     seed=seed, extra_body={"structured_outputs": {"choice": choices},
                                                                            "guided_decoding_backend": "xgrammar"})
            assert picked.choices[0].text in choices
        regex = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=1.0, seed=1,
                                                     extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}})
        assert len(regex.choices[0].message.content) == 6 and regex.choices[0].message.content[3] == "-"
        for extra, param in (({"structured_outputs": {"choice": choices}, "guided_regex": "a+"}, "structured_outputs"),
                             ({"structured_outputs": {"choice": choices, "regex": "a+"}}, "structured_outputs"),
                             ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5, extra_body=extra)
            assert refused.value.body["param"] == param


async def test_numbers_as_strings_and_continuous_usage_stats(tiny_model, tokenizer):
    limits = RequestLimits(max_logprobs=2)
    async with vllm_surface(tiny_model, tokenizer, limits=limits) as (client, http, _):
        answer = (await http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": "3",
                                                            "temperature": "0", "seed": "7"})).json()
        assert answer["usage"]["completion_tokens"] == 3
        greedy = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert answer["choices"][0]["text"] == greedy.choices[0].text
        stream = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True},
                                                      stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})
        usages = [chunk.usage for chunk in [c async for c in stream]]
        assert all(u is not None for u in usages)  # every chunk carries the usage so far
        generated = [u.completion_tokens for u in usages]
        assert generated == sorted(generated) and generated[0] == 0 and generated[-1] == 6
        assert {u.prompt_tokens for u in usages} == {usages[-1].prompt_tokens}
        with pytest.raises(openai.BadRequestError, match="max-logprobs"):  # --max-logprobs 2
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=3)
        assert (await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=2)).choices


async def test_unknown_fields_stay_400s_naming_them(tiny_model, tokenizer):
    async with vllm_surface(tiny_model, tokenizer) as (client, _, _):
        for field in ("bad_words", "priorityy", "lora_request"):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: 1})
            assert refused.value.body["param"] == field and field in refused.value.body["message"]
        assert (await client.completions.create(model=MODEL, prompt="x", max_tokens=2)).choices


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
FORMATS = {  # what each parser reads, as the model would write it
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                   "</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("parser", sorted(FORMATS))
async def test_tool_call_parser_reads_its_format_whatever_the_template(tiny_model, tokenizer, parser):
    """The tiny model's template shows Hermes calls; ``--enable-auto-tool-choice --tool-call-parser X`` reads X.
    The model writes the call only when made to: a regex constraint makes it, the parser reads it."""
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=120,
                extra_body={"guided_regex": r"Sure\. " + re.escape(FORMATS[parser])})
    options = HTTPOptions(tool_call_parser=parser, auto_tool_choice=True)
    async with vllm_surface(tiny_model, tokenizer, options) as (client, _, _):
        answer = await client.chat.completions.create(**body)
        (call,) = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content == "Sure. "
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                               "days": 2}
    async with vllm_surface(tiny_model, tokenizer) as (client, _, _):  # the template's own parser: Hermes
        answer = await client.chat.completions.create(**body)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content == "Sure. " + FORMATS[parser]
