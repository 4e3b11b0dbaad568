"""SGLang's native ``POST /generate`` as slime, miles and AReaL call it.

Answer shapes and refusals against ``FakeBackend``; token-exact behaviour against a real engine in direct mode:
slime's own payload (``slime/rollout/sglang_rollout.py``: ``input_ids``, ``sampling_params`` with
``max_new_tokens``, ``no_stop_trim``, ``spaces_between_special_tokens``, ``return_logprob``) gets the ids and log
probs ``/inference/v1/generate`` gets, and a tiny mixture-of-experts model's ``routed_experts`` decode (as slime
decodes them: base64 int32, ``(len(tokens) - 1, layers, top_k)``) to the rows of ``return_routing_indices``; slime's
``custom_params.return_top_p_token_ids`` (its top-p patch of SGLang) gets each token's kept ids, equal to
transformers' own top-p warper on the logits transformers computes for the same ids.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.limits import RequestLimits
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.server import create_app
from megatron_serve.tokenizer import Tokenizer

from ..conftest import serving, surface
from .tokens_app import error_of, events, fake_http

pytestmark = pytest.mark.timeout(300)


def slime_params(max_new_tokens: int, **extra) -> dict:
    """The sampling parameters slime's rollout sends (its GenerateState), greedy."""
    return {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens, "stop": None,
            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
            "spaces_between_special_tokens": False, **extra}


async def test_an_answer_has_sglangs_fields_single_batched_and_streamed(tokenizer):
    async with fake_http(tokenizer) as http:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}, "rid": "sample-1",
                "return_logprob": True, "return_text_in_logprobs": True}
        one = (await http.post("/generate", json=body)).json()
        meta = one["meta_info"]
        assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 3
        assert meta["id"] == "sample-1" and meta["finish_reason"] == {"type": "length", "length": 3}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 3)
        assert [entry[1] for entry in meta["output_token_logprobs"]] == one["output_ids"]
        assert [entry[2] for entry in meta["output_token_logprobs"]] == [tokenizer.token_text(t)
                                                                           for t in one["output_ids"]]
        assert meta["weight_versions"] == [{"start": 0, "end": 3, "version": meta["weight_version"]}]

        batch = (await http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "rid": ["a", "b"],
                                                    "sampling_params": {"max_new_tokens": 2, "n": 2}})).json()
        assert [a["meta_info"]["id"] for a in batch] == ["a_0", "a_1", "b_0", "b_1"]
        assert [a["index"] for a in batch] == [0, 1, 2, 3] and batch[0]["output_ids"] == batch[1]["output_ids"]
        texts = (await http.post("/generate", json={"text": ["Hello", "there"],
                                                    "sampling_params": {"max_new_tokens": 2}})).json()
        assert len(texts) == 2 and texts[0]["meta_info"]["id"] != texts[1]["meta_info"]["id"]

        streamed = events((await http.post("/generate", json={**body, "stream": True})).text)
        for before, after in zip(streamed, streamed[1:]):  # SGLang's cumulative events: each the answer so far
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
            assert before["meta_info"]["finish_reason"] is None
        assert streamed[-1]["output_ids"] == one["output_ids"] and streamed[-1]["text"] == one["text"]
        assert streamed[-1]["meta_info"]["finish_reason"] == meta["finish_reason"]


async def test_generate_refuses_what_it_cannot_honour_naming_the_field(tokenizer):
    async with fake_http(tokenizer) as http:
        cases = [
            ({"sampling_params": {}}, "input_ids"),
            ({"input_ids": [5], "text": "both"}, "input_ids"),
            ({"input_ids": [600]}, "input_ids"),
            ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
            ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
            ({"input_ids": [5], "sampling_params": {"custom_params": {"my_processor_arg": 1}}},
             "sampling_params.custom_params.my_processor_arg"),
            ({"input_ids": [5], "sampling_params": {"custom_params": {"return_top_p_token_ids": "yes"}}},
             "sampling_params.custom_params.return_top_p_token_ids"),
            ({"input_ids": [5], "sampling_params": {"spaces_between_special_tokens": True}},
             "sampling_params.spaces_between_special_tokens"),
            ({"input_ids": [[5], [6]], "rid": ["only-one"]}, "rid"),
            ({"input_ids": [5], "image_data": ["x"]}, "image_data"),
            ({"input_ids": [5], "return_hidden_states": True}, "return_hidden_states"),
        ]
        for body, param in cases:
            assert error_of(await http.post("/generate", json=body))["param"] == param, body


async def test_slimes_payload_gets_the_ids_and_log_probs_generate_gets(tiny_model, tokenizer):
    prompt = tokenizer.encode("A rollout, as slime sends it", add_special_tokens=False)
    async with surface(tiny_model, tokenizer) as (_, http):
        vllm = (await http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}})).json()["choices"][0]
        payload = {"input_ids": prompt, "sampling_params": slime_params(8, ignore_eos=True), "return_logprob": True}
        answer = (await http.post("/generate", json=payload)).json()
        meta = answer["meta_info"]
        assert answer["output_ids"] == vllm["token_ids"]
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [e["logprob"] for e in vllm["logprobs"]["content"]]
        assert meta["weight_version"] == vllm["weight_version"]
        assert answer["text"] == tokenizer.decode(answer["output_ids"], skip_special_tokens=False)

        stop = answer["output_ids"][3]  # a stop token the greedy answer meets: SGLang's {type: stop, matched: id}
        stopped = (await http.post("/generate", json={**payload, "sampling_params": slime_params(
            8, stop_token_ids=[stop], ignore_eos=True)})).json()
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        upto = answer["output_ids"][:answer["output_ids"].index(stop) + 1]  # SGLang's output_ids end with it
        assert stopped["output_ids"] == upto and stopped["meta_info"]["completion_tokens"] == len(upto)
        assert len(stopped["meta_info"]["output_token_logprobs"]) == len(upto)
        assert stopped["text"] == tokenizer.decode(upto, skip_special_tokens=False)  # no_stop_trim: its text too
        trimmed = (await http.post("/generate", json={**payload, "sampling_params": {**slime_params(
            8, stop_token_ids=[stop], ignore_eos=True), "no_stop_trim": False}})).json()
        assert trimmed["output_ids"] == upto and trimmed["text"] == tokenizer.decode(upto[:-1],
                                                                                     skip_special_tokens=False)

        scored = (await http.post("/generate", json={**payload, "logprob_start_len": 0})).json()["meta_info"]
        assert [entry[1] for entry in scored["input_token_logprobs"]] == prompt
        assert scored["input_token_logprobs"][0][0] is None and len(scored["input_token_logprobs"]) == len(prompt)


def _int32s(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").tolist()


async def test_slimes_top_p_replay_gets_the_ids_transformers_top_p_keeps(tiny_model, tokenizer):
    prompt = tokenizer.encode("Replay the nucleus", add_special_tokens=False)
    asked = {"custom_params": {"return_top_p_token_ids": True}}
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    async with surface(tiny_model, tokenizer) as (_, http):
        async def generate(**params) -> dict:
            answer = await http.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                                        "sampling_params": slime_params(6, ignore_eos=True, **params)})
            assert answer.status_code == 200, answer.text
            return answer.json()

        nucleus = await generate(temperature=0.8, top_p=0.7, sampling_seed=3, **asked)
        greedy = await generate(**asked)
        unfiltered = await generate(temperature=1.0, sampling_seed=3, **asked)
        control = await generate(temperature=0.8, top_p=0.7, sampling_seed=3)
    ids, meta = nucleus["output_ids"], nucleus["meta_info"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
    processed = TopPLogitsWarper(0.7)(None, TemperatureLogitsWarper(0.8)(None, logits))
    expected: list[list[int]] = []
    for row in processed:
        values, order = row.sort(descending=True, stable=True)
        expected.append(order[torch.isfinite(values)].tolist())
    offsets = _int32s(meta["top_p_token_offsets"])
    assert len(offsets) == len(ids) + 1 and offsets[0] == 0
    flat = _int32s(meta["top_p_token_ids"])
    assert [flat[a:b] for a, b in zip(offsets, offsets[1:])] == expected
    assert all(1 < len(kept) < logits.shape[-1] for kept in expected)  # the filter kept some, not all
    assert all(token in kept for token, kept in zip(ids, expected))
    renormalized = torch.log_softmax(processed, -1)[torch.arange(len(ids)), ids].tolist()
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(renormalized, abs=1e-4)

    assert _int32s(greedy["meta_info"]["top_p_token_ids"]) == greedy["output_ids"]  # greedy: its token alone
    assert _int32s(greedy["meta_info"]["top_p_token_offsets"]) == list(range(7))
    assert "top_p_token_ids" not in unfiltered["meta_info"]  # no filter: neither key, as SGLang's patch
    assert "top_p_token_offsets" not in unfiltered["meta_info"]
    assert control["output_ids"] == ids and "top_p_token_ids" not in control["meta_info"]  # the flag off: no keys
    raw = torch.log_softmax(logits, -1)[torch.arange(len(ids)), ids].tolist()
    assert [lp for lp, _, _ in control["meta_info"]["output_token_logprobs"]] == pytest.approx(raw, abs=1e-4)


async def test_kept_ids_bounded_by_top_k_count_in_the_request_budget_before_any_work(tokenizer):
    """``--max-request-logprobs`` counts kept ids up front where their most is known: top_k 400 on 30 tokens asks up
    to 12,000, over a budget of 10,000, and is refused before anything is submitted, naming the budget. Top-p alone
    (slime's ``--rollout-top-k -1``) is served: its most, the vocabulary of 512 per token (15,360), was refused
    before; its ids are counted as produced (tests/coordinator/test_kept_ids_budget.py). The controls are served too:
    the flag off, top_k 20 (600 ids), greedy (one id per token)."""
    nucleus = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30}
    asked = {"custom_params": {"return_top_p_token_ids": True}}
    async with fake_http(tokenizer, limits=RequestLimits(max_request_logprobs=10_000)) as http:
        async def generate(**params) -> httpx.Response:
            return await http.post("/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                      "sampling_params": params})

        refused = error_of(await generate(**nucleus, **asked, top_k=400))
        assert "--max-request-logprobs" in refused["message"] and "12,030" in refused["message"], refused
        assert "12,000 top-p token ids" in refused["message"] and "budget of 10,000" in refused["message"]
        assert refused["code"] == "over_budget"
        for control in ({**nucleus, **asked}, {**nucleus}, {**nucleus, **asked, "top_k": 20},
                        {**nucleus, **asked, "temperature": 0}):
            answer = await generate(**control)
            assert answer.status_code == 200, (control, answer.text)


async def test_routed_experts_decode_to_the_engines_rows_in_both_anchors_shapes(tmp_path):
    moe = str(make_tiny_model(tmp_path / "tiny-moe", seed=0, arch="mixtral"))
    tokenizer = Tokenizer.from_pretrained(moe)
    prompt = tokenizer.encode("Route these tokens")
    async with MegatronAsyncLLM(moe, InferenceConfig(dtype="float32", num_kv_blocks=64)) as llm:
        app = create_app(llm.client, tokenizer, "tiny-moe", vocab_size=512, max_model_len=1024, status_interval=0.05)
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            rows = (await http.post("/v1/completions", json={
                "model": "tiny-moe", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_routing_indices": True})).json()["choices"][0]["routing_indices"]
            shape = (len(prompt) + 4 - 1, len(rows[0]), len(rows[0][0]))
            sglang = (await http.post("/generate", json={"input_ids": prompt, "return_routed_experts": True,
                                                         "sampling_params": slime_params(4, ignore_eos=True)})).json()
            packed = base64.b64decode(sglang["meta_info"]["routed_experts"].encode("ascii"))
            assert np.frombuffer(packed, dtype=np.int32).reshape(shape).tolist() == rows
            vllm = (await http.post("/inference/v1/generate", json={
                "token_ids": prompt, "return_routed_experts": True,
                "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})).json()
            saved = np.load(io.BytesIO(base64.b64decode(vllm["choices"][0]["routed_experts"])))
            assert saved.tolist() == rows and saved.shape == shape
            plain = (await http.post("/generate", json={"input_ids": prompt, "sampling_params": slime_params(4)}))
            assert "routed_experts" not in plain.json()["meta_info"]
