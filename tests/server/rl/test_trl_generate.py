"""TRL's own ``trl vllm-serve`` protocol (TRL <= 1.10): ``/generate/``, ``/chat/``, ``/get_sequence_logprobs/``.

The bodies are the ones TRL 1.10's ``VLLMClient`` sends (``trl/generation/vllm_client.py``: ``generate``,
``chat``, ``get_sequence_logprobs`` with ``use_binary`` both ways), replayed over HTTP against a real engine in
direct mode, and the answers are read as that client reads them (``_decode_binary_logprobs`` for the binary
format). Every id is compared ``==`` with what the OpenAI routes answer for the same prompts; refusals name the
field, against ``FakeBackend``.
"""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest

from ..conftest import surface
from .tokens_app import MODEL, error_of, fake_http

pytestmark = pytest.mark.timeout(300)

CONVERSATIONS = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Count to three"}]]


def client_body(**fields) -> dict:
    """Every field ``VLLMClient.generate`` and ``.chat`` send, greedy (``generation_kwargs`` as a trainer adds them)."""
    return {"n": 2, "repetition_penalty": 1.0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "max_tokens": 5, "logprobs": 0, "structured_outputs_regex": None,
            "generation_kwargs": {"ignore_eos": True}, **fields}


def decode_binary(answer: dict) -> dict:
    """``VLLMClient._decode_binary_logprobs``: the arrays back to nested lists, the padding cut."""
    shape = answer["shape"]
    values = np.frombuffer(base64.b64decode(answer["logprobs_b64"]), dtype=np.float32).reshape(shape)
    ids = np.frombuffer(base64.b64decode(answer["token_ids_b64"]), dtype=np.int32).reshape(shape)
    actual = np.frombuffer(base64.b64decode(answer["actual_logprobs_b64"]), dtype=np.float32).reshape(
        [*shape[:2], 1])
    actual_ids = np.frombuffer(base64.b64decode(answer["actual_token_ids_b64"]), dtype=np.int32).reshape(
        [*shape[:2], 1])
    lengths = answer["completion_lengths"]
    return {"logprobs": [values[i, :n].tolist() for i, n in enumerate(lengths)],
            "logprob_token_ids": [ids[i, :n].tolist() for i, n in enumerate(lengths)],
            "actual_logprobs": [actual[i, :n].tolist() for i, n in enumerate(lengths)],
            "actual_token_ids": [actual_ids[i, :n].tolist() for i, n in enumerate(lengths)]}


async def test_generate_and_chat_answer_the_ids_the_openai_routes_answer(tiny_model, tokenizer):
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("A second prompt")]
    async with surface(tiny_model, tokenizer) as (_, http):
        answer = (await http.post("/generate/", json={"prompts": prompts, "images": None, **client_body()})).json()
        expected = (await http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True})).json()["choices"]
        assert answer["prompt_ids"] == prompts
        assert answer["completion_ids"] == [c["token_ids"] for c in expected]
        assert answer["logprobs"] == [[[lp] for lp in c["logprobs"]["token_logprobs"]] for c in expected]
        assert answer["logprob_token_ids"] == [[[t] for t in c["token_ids"]] for c in expected]

        ranked = (await http.post("/generate/", json={"prompts": prompts[:1], **client_body(logprobs=2)})).json()
        for values, ids, sampled in zip(ranked["logprobs"][0], ranked["logprob_token_ids"][0],
                                        ranked["completion_ids"][0]):
            assert values == sorted(values, reverse=True) and sampled in ids and len(ids) in (2, 3)
        texts = (await http.post("/generate/", json={"prompts": ["Hello there"], **client_body(n=1)})).json()
        assert texts["prompt_ids"] == [prompts[0]] and texts["completion_ids"][0] == expected[0]["token_ids"]

        chat = (await http.post("/chat/", json={"messages": CONVERSATIONS, "chat_template_kwargs": {}, "tools": None,
                                                **client_body(n=1)})).json()
        for i, conversation in enumerate(CONVERSATIONS):
            asked = {"model": MODEL, "messages": conversation, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            rendered = (await http.post("/v1/chat/completions/render", json=asked)).json()["token_ids"]
            reply = (await http.post("/v1/chat/completions", json={**asked, "return_token_ids": True})).json()
            assert chat["prompt_ids"][i] == rendered and chat["completion_ids"][i] == reply["choices"][0]["token_ids"]


async def test_sequence_logprobs_score_the_completions_in_both_formats(tiny_model, tokenizer):
    sequences = [tokenizer.encode("A teacher scores this answer"), tokenizer.encode("and this one")]
    lengths = [3, 0]
    request = {"sequences": sequences, "prompt_lengths": lengths, "top_logprobs": 2, "temperature": 1.0}
    async with surface(tiny_model, tokenizer) as (_, http):
        as_json = (await http.post("/get_sequence_logprobs/", json={**request, "response_format": "json"})).json()
        binary = decode_binary((await http.post("/get_sequence_logprobs/",
                                                json={**request, "response_format": "binary"})).json())
        for i, sequence in enumerate(sequences):
            scored = (await http.post("/v1/completions", json={
                "model": MODEL, "prompt": sequence, "max_tokens": 0, "prompt_logprobs": 2})).json()
            positions = scored["choices"][0]["prompt_logprobs"]
            rows, ids = as_json["logprobs"][i], as_json["logprob_token_ids"][i]
            assert len(rows) == len(sequence) - lengths[i] == len(binary["actual_logprobs"][i])
            for offset, position in enumerate(range(lengths[i], len(sequence))):
                if position == 0:  # the first token has no context: nothing scored
                    assert rows[offset] == [] and binary["actual_logprobs"][i][offset] == [-math.inf]
                    continue
                actual = sequence[position]
                expected = positions[position][str(actual)]["logprob"]
                assert actual in ids[offset] and rows[offset][ids[offset].index(actual)] == expected
                assert rows[offset] == sorted(rows[offset], reverse=True)
                assert binary["actual_token_ids"][i][offset] == [actual]
                assert binary["actual_logprobs"][i][offset] == [pytest.approx(expected, abs=1e-6)]
                assert binary["logprob_token_ids"][i][offset] == ids[offset][:2]
                assert binary["logprobs"][i][offset] == pytest.approx(rows[offset][:2], abs=1e-6)


async def test_the_routes_refuse_what_they_cannot_honour_naming_the_field(tokenizer):
    async with fake_http(tokenizer) as http:
        cases = [
            ("/generate/", {"prompts": [[5]], "images": [["aW1n"]]}, "images[0]"),
            ("/generate/", {"prompts": [[5]], "generation_kwargs": {"bad_words": ["x"]}},
             "generation_kwargs.bad_words"),
            ("/generate/", {"prompts": [[5]], "generation_kwargs": {"seed": "x"}}, "generation_kwargs.seed"),
            ("/generate/", {"prompts": [[600]]}, "prompts"),
            ("/generate/", {"prompts": [[5]], "max_tokens": -1}, "max_tokens"),
            ("/chat/", {"messages": [CONVERSATIONS[0], [{"role": "wizard", "content": "x"}]]},
             "messages[1][0].role"),
            ("/chat/", {"messages": []}, "messages"),
            ("/get_sequence_logprobs/", {"sequences": [[5, 6]], "prompt_lengths": [1, 1]}, "prompt_lengths"),
            ("/get_sequence_logprobs/", {"sequences": [[5, 6]], "prompt_lengths": [3]}, "prompt_lengths[0]"),
            ("/get_sequence_logprobs/", {"sequences": [[5, 6]], "prompt_lengths": [1], "response_format": "xml"},
             "response_format"),
            ("/get_sequence_logprobs/", {"sequences": [[5, 6]], "prompt_lengths": [1], "top_logprobs": 10_000},
             "top_logprobs"),
        ]
        for path, body, param in cases:
            assert error_of(await http.post(path, json=body))["param"] == param, (path, body)
