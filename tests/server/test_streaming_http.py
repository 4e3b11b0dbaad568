"""Streams over HTTP with the official ``openai`` client against a real engine (direct mode, in this process):
under concurrency no chunk is lost, reordered or duplicated and every streamed text equals the same
request answered whole; ``--stream-interval`` groups tokens; the detokenizer options of vLLM
(``skip_special_tokens``, ``include_stop_str_in_output``) do what they say; event data never holds a
raw Unicode line break.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve.server import create_app
from megatron_serve.server.chunks import event

from .conftest import serving, surface
from .fakes import FakeBackend

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
PROMPTS = [f"Stream {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(50)]
IGNORE_EOS = {"ignore_eos": True}


def served(tiny_model: str, tokenizer, **app_options):
    return surface(tiny_model, tokenizer, app_options, num_kv_blocks=1024, max_requests=64)


async def test_fifty_concurrent_streams_equal_their_whole_answers(tiny_model, tokenizer):
    async with served(tiny_model, tokenizer) as (client, _):
        async def streamed(prompt: str) -> tuple[str, list[str], str | None]:
            text, tokens, finish = "", [], None
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                     stream=True, logprobs=0, extra_body=IGNORE_EOS)
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.text
                    tokens += choice.logprobs.tokens if choice.logprobs else []
                    finish = choice.finish_reason or finish
            return text, tokens, finish

        async def whole(prompt: str):
            return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                   logprobs=0, extra_body=IGNORE_EOS)

        streams = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        answers = await asyncio.gather(*(whole(p) for p in PROMPTS))
        for prompt, (text, tokens, finish), answer in zip(PROMPTS, streams, answers):
            choice = answer.choices[0]
            assert text == choice.text, prompt  # nothing lost, reordered or duplicated
            assert tokens == choice.logprobs.tokens and len(tokens) == 24, prompt  # every token listed once, in order
            assert "".join(tokens) == text and finish == choice.finish_reason == "length"


async def test_stream_interval_sends_tokens_in_groups_with_the_first_at_once(tiny_model, tokenizer):
    async with served(tiny_model, tokenizer, stream_interval=5) as (client, _):
        counts, text = [], ""
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=21, temperature=0,
                                                 stream=True, logprobs=0, extra_body=IGNORE_EOS)
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                counts.append(len(choice.logprobs.tokens) if choice.logprobs else 0)
        whole = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=21, temperature=0,
                                                extra_body=IGNORE_EOS)
        assert text == whole.choices[0].text
        listed = [c for c in counts if c]
        assert sum(listed) == 21 and listed[0] == 1 and len(listed) <= 6, counts  # 1, then groups of 5 (or less)


async def test_skip_special_tokens_and_include_stop_str_in_output(tiny_model, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    async with served(tiny_model, tokenizer) as (client, _):
        forced = {"ignore_eos": True, "logit_bias": {str(eos): 100}}
        skipped = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                                  extra_body=forced)
        shown = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                                extra_body={**forced, "skip_special_tokens": False})
        assert skipped.usage.completion_tokens == shown.usage.completion_tokens == 3
        assert skipped.choices[0].text == "" and shown.choices[0].text == tokenizer.token_text(eos) * 3

        free = await client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                               extra_body=IGNORE_EOS)
        text = free.choices[0].text
        stop = text[len(text) // 2: len(text) // 2 + 2]
        for include, expected in ((False, text[: text.index(stop)]), (True, text[: text.index(stop) + len(stop)])):
            body = {**IGNORE_EOS, "include_stop_str_in_output": include}
            whole = await client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                                    stop=[stop], extra_body=body)
            stream = await client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                                     stop=[stop], stream=True, extra_body=body)
            pieces = [c.choices[0].text async for c in stream if c.choices]
            assert whole.choices[0].text == "".join(pieces) == expected and whole.choices[0].finish_reason == "stop"


class LineBreaks(FakeBackend):
    """Generates the tokens of a text with the Unicode line breaks that JSON leaves unescaped."""

    def __init__(self, tokenizer, text: str) -> None:
        super().__init__(tokenizer, max_sequence_length=512)
        self.ids = tokenizer.encode(text, add_special_tokens=False)

    def next_token(self, prompt: list[int], i: int, seed: int | None) -> int:
        return self.ids[i % len(self.ids)]


async def test_event_data_escapes_unicode_line_breaks(tokenizer):
    text = "one\u2028two\u2029three\u0085four"
    backend = LineBreaks(tokenizer, text)
    async with serving(create_app(backend, tokenizer, MODEL)) as url, httpx.AsyncClient(base_url=url) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": len(backend.ids), "stream": True}
        raw = (await http.post("/v1/completions", json=body)).content
    assert not any(c in raw.decode() for c in "\u2028\u2029\u0085")
    lines = raw.decode().splitlines()  # what a reader that splits on every Unicode line break sees
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert event(b'"\xe2\x80\xa8\xc2\x85"') == b'data: "\\u2028\\u0085"\n\n'


async def test_plain_streams_write_later_tokens_from_their_text_alone_and_equal_their_whole_answers(
        tiny_model, tokenizer, monkeypatch):
    """A plain stream's tokens after its first go from the client's collector to the answer's writer as text alone
    (``_TextTagged.put_text``, counted by a wrapper that keeps it), completions and chats alike, and the text is the
    whole answer's; a stream whose chunks list token ids takes whole pieces, each with its ids. Once the response
    is being poured, a plain stream's sink writes those chunks into the connection's transport itself (the writer's
    lane: ``generation.write_text_event``, counted); two choices' pieces are gathered by the writer instead."""
    from megatron_serve.server import generation

    taken: list[str] = []
    put_text = generation._TextTagged.put_text

    def counted(self, text: str) -> bool:
        took = put_text(self, text)
        if took:
            taken.append(text)
        return took

    direct: list[str] = []
    write_text_event = generation.write_text_event

    def written(transport, before: bytes, text: str, after: bytes) -> bytes | None:
        unwritten = write_text_event(transport, before, text, after)
        if unwritten is None:
            direct.append(text)
        return unwritten

    monkeypatch.setattr(generation._TextTagged, "put_text", counted)
    monkeypatch.setattr(generation, "write_text_event", written)
    async with served(tiny_model, tokenizer) as (client, _):
        async def completion(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                     stream=True, extra_body=IGNORE_EOS)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def chat(prompt: str) -> str:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                stream=True, extra_body=IGNORE_EOS)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        prompts = PROMPTS[:10]
        streamed = await asyncio.gather(*(completion(p) for p in prompts), *(chat(p) for p in prompts))
        assert len(taken) >= 20 * 10  # most of each stream's 15 later tokens (a held byte's text comes whole)
        assert len(direct) >= 20 * 5  # straight into the connection by the sink (those before the response started
        # wait in the writer and go out as one chunk)
        lanes = len(direct)
        whole = [(await client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                  extra_body=IGNORE_EOS)).choices[0].text for p in prompts]
        chats = [(await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0,
            extra_body=IGNORE_EOS)).choices[0].message.content for p in prompts]
        assert streamed == whole + chats

        taken.clear()  # two choices a step: their texts alone, gathered into one chunk a step
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, n=2,
                                                 stream=True, extra_body=IGNORE_EOS)
        texts = ["", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [whole[0], whole[0]] and len(taken) >= 2 * 10
        assert len(direct) == lanes  # gathered by the writer, one chunk a step: no lane writes alone

        taken.clear()
        stream = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                                 stream=True, extra_body={**IGNORE_EOS, "return_token_ids": True})
        ids = [c.choices[0].model_extra["token_ids"] async for c in stream if c.choices]
        assert taken == [] and sum(len(i or []) for i in ids) == 16
