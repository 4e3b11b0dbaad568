"""Log-prob listings agree with the text, over a real (direct-mode) engine and the byte-level tiny tokenizer.

Seeded sampling at temperature 1 from random weights draws special tokens (end-of-sequence among
them, kept by ``ignore_eos``), byte tokens that split characters, and stop strings that trim
tokens away. Before, ``text_offset`` ran past the end of ``text`` in 6 of 40 such samples and
sampled special tokens were listed although the text lacked them. Now every listed token is the
text it adds: they concatenate to the text, whole and streamed, for completions and chat.
"""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_serve import MegatronAsyncLLM
from megatron_serve.client.detokenizer import IncrementalDetokenizer
from megatron_serve.server import create_app

from .conftest import serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny-llama"
SEEDS = range(20)  # 40 before: each fourth with stop strings, and enough draws for empty token texts (asserted)


def events(text: str) -> list[dict]:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def check_completion_listing(text: str, logprobs: dict, completion_tokens: int) -> int:
    """The invariants of one choice; returns how many listed tokens add no text."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets) == len(logprobs["token_logprobs"]) == completion_tokens
    assert "".join(tokens) == text
    for token, offset in zip(tokens, offsets):
        assert 0 <= offset <= len(text) and text[offset:offset + len(token)] == token
    return sum(1 for t in tokens if t == "")


async def test_completion_offsets_and_tokens_match_the_text(tiny_model, tokenizer):
    empty = 0
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            for seed in SEEDS:
                body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 1.0,
                        "seed": seed, "logprobs": 2, "ignore_eos": True}
                if seed % 4 == 0:
                    body["stop"] = ["e", "a"]  # trims the text, and the tokens past it add nothing
                whole = (await http.post("/v1/completions", json=body)).json()
                choice = whole["choices"][0]
                empty += check_completion_listing(choice["text"], choice["logprobs"],
                                                  whole["usage"]["completion_tokens"])

                streamed = await http.post("/v1/completions", json={**body, "stream": True})
                chunks = [c["choices"][0] for c in events(streamed.text) if c["choices"]]
                text = "".join(c["text"] for c in chunks)
                listed = [c["logprobs"] for c in chunks if c["logprobs"]]
                tokens = [t for block in listed for t in block["tokens"]]
                offsets = [o for block in listed for o in block["text_offset"]]
                assert text == choice["text"] and tokens == choice["logprobs"]["tokens"]
                assert offsets == choice["logprobs"]["text_offset"]
                sent = 0
                for c in chunks:  # a chunk lists only tokens whose text has been sent
                    sent += len(c["text"])
                    if c["logprobs"]:
                        assert c["logprobs"]["text_offset"][-1] + len(c["logprobs"]["tokens"][-1]) <= sent
    assert empty > 0  # special tokens, split characters or stop strings were drawn: the hard cases ran


async def test_chat_token_entries_concatenate_to_the_content(tiny_model, tokenizer):
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            for seed in range(0, 40, 8):  # every fourth of 40 before
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32,
                        "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
                whole = (await http.post("/v1/chat/completions", json=body)).json()
                choice = whole["choices"][0]
                entries = choice["logprobs"]["content"]
                assert len(entries) == whole["usage"]["completion_tokens"]
                assert "".join(e["token"] for e in entries) == choice["message"]["content"]
                assert all(bytes(e["bytes"]).decode() == e["token"] for e in entries)
                streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
                chunks = [c["choices"][0] for c in events(streamed.text) if c["choices"]]
                content = "".join(c["delta"].get("content", "") for c in chunks)
                listed = [e["token"] for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
                assert content == choice["message"]["content"] and listed == [e["token"] for e in entries]


@pytest.mark.parametrize("stop", [None, ["e", "a"]])
async def test_text_and_token_texts_are_made_once_and_stream_as_the_whole_answer(tiny_model, tokenizer, monkeypatch,
                                                                                  stop):
    """The client's output processor makes the text and every token's text in one pass: the detokenizer
    decodes each generated token once (before, the HTTP layer decoded them all again for the listing, 2
    windows per token), and the streamed chunks, written from the pieces alone, add up to the answer
    (text, listed tokens with their texts and log probs) that the same seeded request gets whole."""
    windows = 0
    decode = IncrementalDetokenizer._window

    def counted(self: IncrementalDetokenizer, new_tokens) -> str:
        nonlocal windows
        windows += 1
        return decode(self, new_tokens)

    monkeypatch.setattr(IncrementalDetokenizer, "_window", counted)
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 3,
                    "logprobs": 2, "ignore_eos": True, "stop": stop}
            windows = 0
            whole = (await http.post("/v1/completions", json=body)).json()
            generated = whole["usage"]["completion_tokens"]
            assert generated > 0 and windows == generated  # one window per token, text and listing together
            choice = whole["choices"][0]

            windows = 0
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            assert windows == generated
            chunks = [c["choices"][0] for c in events(streamed.text) if c["choices"]]
            listed = [c["logprobs"] for c in chunks if c["logprobs"]]
            assert "".join(c["text"] for c in chunks) == choice["text"]
            for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
                assert [x for block in listed for x in block[key]] == choice["logprobs"][key], key
            assert chunks[-1]["finish_reason"] == choice["finish_reason"]
