"""vLLM's tokens-in, tokens-out routes: ``POST /inference/v1/generate``, ``POST /v1/chat/completions/render``, and
``return_tokens_as_token_ids`` on the OpenAI routes.

Answer shapes and refusals against ``FakeBackend``; token-exact behaviour (``==``) against a real engine in
direct mode (``conftest.surface``): the ids a generate answer holds are those ``/v1/completions`` generates for the
same prompt ids, and the body ``render`` answers runs on ``/inference/v1/generate`` exactly what
``/v1/chat/completions`` runs. Field names are vLLM's (``vllm/entrypoints/serve/disagg/protocol.py``).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron_serve import MegatronAsyncLLM
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.server import create_app

from ..conftest import serving, surface
from .tokens_app import MODEL, error_of, events, fake_http

pytestmark = pytest.mark.timeout(300)

GENERATE, RENDER = "/inference/v1/generate", "/v1/chat/completions/render"
ASK = [{"role": "user", "content": "Which tokens did you write?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def ids_of(listing: dict) -> list[str]:
    return [entry["token"] for entry in listing["content"]]


async def test_a_generate_answer_has_vllms_fields_whole_and_streamed(tokenizer):
    async with fake_http(tokenizer) as http:
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "logprobs": 1, "n": 2}}
        whole = await http.post(GENERATE, json=body, headers={"X-Request-Id": "rollout-7"})
        answer = whole.json()
        assert set(answer) == {"request_id", "choices", "usage", "prompt_logprobs", "kv_transfer_params"}
        assert answer["request_id"] == "rollout-7" and answer["prompt_logprobs"] is None
        assert answer["usage"]["prompt_tokens"] == 3 and answer["usage"]["completion_tokens"] == 8
        for index, choice in enumerate(answer["choices"]):
            assert choice["index"] == index and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
            assert ids_of(choice["logprobs"]) == [f"token_id:{t}" for t in choice["token_ids"]]
            assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in choice["logprobs"]["content"])
            assert choice["weight_versions"] == [{"start": 0, "end": 4, "version": choice["weight_version"]}]
            assert choice["routed_experts"] is None  # not asked for

        streamed = await http.post(GENERATE, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = events(streamed.text)
        tokens: dict[int, list[int]] = {0: [], 1: []}
        finals = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            tokens[choice["index"]] += choice["token_ids"]
            if choice["finish_reason"] is not None:
                finals[choice["index"]] = choice
        assert tokens == {c["index"]: c["token_ids"] for c in answer["choices"]}
        assert {i: c["finish_reason"] for i, c in finals.items()} == {0: "length", 1: "length"}
        assert finals[0]["weight_version"] == answer["choices"][0]["weight_version"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


async def test_generate_refuses_what_it_cannot_honour_naming_the_field(tokenizer):
    async with fake_http(tokenizer) as http:
        cases = [
            ({"token_ids": []}, "token_ids"),
            ({"token_ids": [600]}, "token_ids"),
            ({"token_ids": [5], "sampling_params": {"max_tokens": -1}}, "sampling_params.max_tokens"),
            ({"token_ids": [5], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
            ({"token_ids": [5], "sampling_params": {"allowed_token_ids": [600]}}, "sampling_params.allowed_token_ids"),
            ({"token_ids": [5], "sampling_params": {"extra_args": {"my_processor": 1}}},
             "sampling_params.extra_args.my_processor"),
            ({"token_ids": [5], "features": {"mm_hashes": {}}}, "features"),
            ({"sampling_params": {}}, "token_ids"),
        ]
        for body, param in cases:
            assert error_of(await http.post(GENERATE, json=body))["param"] == param, body
        pinned = await http.post(GENERATE, json={"token_ids": [5]}, headers={"X-data-parallel-rank": "1"})
        assert error_of(pinned)["param"] == "X-data-parallel-rank"
        unknown = await http.post(GENERATE, json={"token_ids": [5], "model": "other"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        # what only changes how vLLM makes its outputs is taken: the answer is the same
        quiet = {"output_kind": 2, "detokenize": False, "flat_logprobs": True,
                 "extra_args": {"prl_compact_logprobs": True}, "max_tokens": 3}
        plain = (await http.post(GENERATE, json={"token_ids": [5, 6], "sampling_params": {"max_tokens": 3}})).json()
        taken = (await http.post(GENERATE, json={"token_ids": [5, 6], "sampling_params": quiet})).json()
        assert taken["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


async def test_render_answers_the_body_that_runs_the_chat_on_generate(tiny_model, tokenizer):
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 7, "logprobs": True, "top_logprobs": 2, **GREEDY}
    async with surface(tiny_model, tokenizer) as (_, http):
        rendered = (await http.post(RENDER, json=chat)).json()
        answer = (await http.post("/v1/chat/completions", json={**chat, "return_token_ids": True,
                                                                 "return_epochs": True})).json()
        assert rendered["token_ids"] == answer["prompt_token_ids"]
        assert rendered["sampling_params"]["max_tokens"] == 7 and rendered["sampling_params"]["logprobs"] == 2
        assert rendered["model"] == MODEL and rendered["stream"] is False

        generated = (await http.post(GENERATE, json=rendered)).json()
        (choice,) = generated["choices"]
        expected = answer["choices"][0]
        assert choice["token_ids"] == expected["token_ids"]
        assert ids_of(choice["logprobs"]) == [f"token_id:{t}" for t in expected["token_ids"]]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == \
            [e["logprob"] for e in expected["logprobs"]["content"]]
        assert choice["weight_version"] == str(expected["policy_epochs"][0])
        assert generated["usage"]["prompt_tokens"] == len(rendered["token_ids"])

        streamed = await http.post(GENERATE, json={**rendered, "stream": True})
        assert [t for chunk in events(streamed.text) for c in chunk["choices"] for t in c["token_ids"]] == \
            expected["token_ids"]


async def test_generate_runs_exactly_the_ids_it_is_given(tiny_model, tokenizer):
    prompt = tokenizer.encode("Tokens in, tokens out")
    async with surface(tiny_model, tokenizer) as (_, http):
        completion = (await http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 6, "logprobs": 2, "prompt_logprobs": 1,
            "return_token_ids": True, **GREEDY})).json()["choices"][0]
        generated = (await http.post(GENERATE, json={"token_ids": prompt, "sampling_params": {
            "max_tokens": 6, "logprobs": 2, "prompt_logprobs": 1, **GREEDY}})).json()
        (choice,) = generated["choices"]
        assert completion["prompt_token_ids"] == prompt
        assert choice["token_ids"] == completion["token_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == completion["logprobs"]["token_logprobs"]
        assert generated["prompt_logprobs"] == completion["prompt_logprobs"]


async def test_return_tokens_as_token_ids_names_listed_tokens_by_id(tiny_model, tokenizer):
    prompt = tokenizer.encode("Name them by id")
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "logprobs": 2, "return_token_ids": True,
                  **GREEDY}
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, **GREEDY}
    by_id = {"return_tokens_as_token_ids": True}
    async with surface(tiny_model, tokenizer) as (_, http):
        text = (await http.post("/v1/completions", json=completion)).json()["choices"][0]
        named = (await http.post("/v1/completions", json={**completion, **by_id})).json()["choices"][0]
        assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
        assert named["logprobs"]["token_logprobs"] == text["logprobs"]["token_logprobs"]
        for top, plain in zip(named["logprobs"]["top_logprobs"], text["logprobs"]["top_logprobs"]):
            assert all(key.startswith("token_id:") for key in top) and sorted(top.values()) == sorted(plain.values())
        streamed = await http.post("/v1/completions", json={**completion, **by_id, "stream": True})
        assert [t for chunk in events(streamed.text) for c in chunk["choices"]
                for t in (c["logprobs"] or {}).get("tokens", [])] == named["logprobs"]["tokens"]

        answer = (await http.post("/v1/chat/completions", json={**chat, **by_id})).json()["choices"][0]
        assert ids_of(answer["logprobs"]) == [f"token_id:{t}" for t in answer["token_ids"]]
        assert all(alt["token"].startswith("token_id:") for e in answer["logprobs"]["content"]
                   for alt in e["top_logprobs"])


async def test_every_token_carries_the_weight_version_it_was_generated_with(tiny_model, tokenizer, tmp_path):
    """The weight version is the REFIT epoch stamped on each token: in vLLM's choice and SGLang's meta_info."""
    second = str(make_tiny_model(tmp_path / "second", seed=1))
    prompt = tokenizer.encode("Which weights made these tokens?")
    generate = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, **GREEDY}}
    sglang = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = (await http.post(GENERATE, json=generate)).json()["choices"][0]
            assert before["weight_version"] == "0" and before["weight_versions"] == [
                {"start": 0, "end": 4, "version": "0"}]
            await llm.refit(second, epoch=4)
            after = (await http.post(GENERATE, json=generate)).json()["choices"][0]
            assert after["weight_version"] == "4" and after["weight_versions"] == [
                {"start": 0, "end": 4, "version": "4"}]
            assert after["token_ids"] != before["token_ids"]  # other weights, another answer
            meta = (await http.post("/generate", json=sglang)).json()["meta_info"]
            assert meta["weight_version"] == "4" and meta["weight_versions"] == after["weight_versions"]
            streamed = events((await http.post(GENERATE, json={**generate, "stream": True})).text)
            assert [c["choices"][0]["weight_version"] for c in streamed if c["choices"][0]["finish_reason"]] == ["4"]


async def test_a_refit_mid_stream_splits_the_answer_into_two_weight_versions(tiny_model, tokenizer, tmp_path):
    """A REFIT lands while a long stream runs: the tokens before it carry the old version, those after the new one
    (SGLang's spans on vLLM's choice), none lost."""
    second = str(make_tiny_model(tmp_path / "second", seed=1))
    body = {"token_ids": tokenizer.encode("A long rollout"), "stream": True,
            "sampling_params": {"max_tokens": 1000, **GREEDY}}
    async with MegatronAsyncLLM(tiny_model) as llm:
        app = create_app(llm.client, tokenizer, MODEL, vocab_size=512, max_model_len=1024, status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            received, refit, final = 0, None, None
            async with http.stream("POST", GENERATE, json=body) as answer:
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    (choice,) = json.loads(line[len("data: "):])["choices"]
                    received += len(choice["token_ids"])
                    if refit is None and received >= 5:  # under way: the new weights land mid-answer
                        refit = asyncio.ensure_future(llm.refit(second, epoch=4))
                    final = choice if choice["finish_reason"] else final
            await refit
    assert received == 1000 and final["finish_reason"] == "length"
    old, new = final["weight_versions"]
    assert old["version"] == final["weight_version"] == "0" and new["version"] == "4"
    assert old["start"] == 0 and 5 <= old["end"] == new["start"] < new["end"] == 1000


async def test_prime_rls_calls_get_what_its_clients_read(tiny_model, tokenizer):
    """The bodies of PrimeIntellect-ai/renderers' ``renderers/client.py`` (``generate``: a top-k head asks
    ``logprobs`` k + 2 with ``flat_logprobs``, ``extra_args.prl_compact_logprobs`` and ``detokenize: false``) and of
    prime-rl's teacher scoring (``compute_teacher_logprobs``: ``max_tokens`` 1, ``prompt_logprobs`` 1), read as they
    read the answers: native JSON log probs named ``token_id:N``, the sampled one first, k + 2 of them."""
    prompt = tokenizer.encode("A prime-rl rollout")
    head = 2
    body = {"model": MODEL, "token_ids": prompt, "cache_salt": "run-7", "priority": 0, "sampling_params": {
        "temperature": 0.0, "max_tokens": 6, "stop_token_ids": [3], "logprobs": head + 2, "flat_logprobs": True,
        "extra_args": {"prl_compact_logprobs": True}, "detokenize": False, "skip_special_tokens": False}}
    async with surface(tiny_model, tokenizer) as (_, http):
        models = (await http.get("/v1/models")).json()["data"]
        assert [card["max_model_len"] for card in models if card["id"] == MODEL] == [1024]
        (choice,) = (await http.post(GENERATE, json=body)).json()["choices"]
        assert "compact_logprobs" not in choice  # the client falls back to the JSON listing
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"]) > 0
        for token, entry in zip(choice["token_ids"], content):
            assert entry["token"] == f"token_id:{token}" and entry["logprob"] != -9999.0
            alternatives = [int(alt["token"].removeprefix("token_id:")) for alt in entry["top_logprobs"]]
            assert alternatives[0] == token and len(set(alternatives)) == len(alternatives) == head + 2
            assert all(alt["logprob"] <= 0 for alt in entry["top_logprobs"])

        teacher = (await http.post(GENERATE, json={"model": MODEL, "token_ids": prompt, "sampling_params": {
            "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}})).json()
        scored = (await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                           "prompt_logprobs": 1})).json()["choices"][0]
        assert teacher["prompt_logprobs"][0] is None

        def actual(scores: list) -> list[float]:  # what compute_teacher_logprobs reads: each prompt token's log prob
            return [position[str(token)]["logprob"] for token, position in zip(prompt[1:], scores[1:])]

        assert actual(teacher["prompt_logprobs"]) == actual(scored["prompt_logprobs"])
