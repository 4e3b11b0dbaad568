"""TRL 1.16's own ``VLLMClient`` (``trl/generation/vllm_client.py``) against the server's vLLM routes.

The client is TRL's, unchanged: only its import-time check that vLLM is installed is answered (vLLM's engine does
not install here, and the client only speaks HTTP to it). The app runs over ``FakeBackend`` (answer shapes, no
model) or a real engine in direct mode (``conftest.surface``: log probs and ranks); the client is synchronous
(``requests``), so each call runs on a thread beside the served app.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import requests

from megatron_serve.http_options import HTTPOptions

from ...helpers import until
from ..conftest import surface
from .control_app import API, controlled
from .tokens_app import events, fake_http

trl_vllm = pytest.importorskip("trl.generation.vllm_client", reason="TRL's client (the test extras pin trl 1.16)")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def vllm_client(monkeypatch):
    """TRL's ``VLLMClient`` class, its "is vLLM installed" check answered yes."""
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *_, **__: True)
    return trl_vllm.VLLMClient


async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def test_generate_with_its_default_logprobs_0_reads_one_logprob_per_token(tokenizer, vllm_client):
    """``generate`` sends ``logprobs: 0`` (GRPOTrainer's default); vLLM answers one ``{token: logprob}`` per
    position, which TRL zips with the tokens: a null ``top_logprobs`` stopped it."""
    async with fake_http(tokenizer) as http:
        client = await call(vllm_client, base_url=str(http.base_url))
        out = await call(client.generate, [[5, 6, 7], [8, 9]], n=2, max_tokens=4)
        assert [len(ids) for ids in out["completion_ids"]] == [4, 4, 4, 4]
        assert out["prompt_ids"] == [[5, 6, 7], [8, 9]]
        for ids, logprobs, tops in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
            assert [top for (top,) in tops] == ids  # one entry a position: the sampled token itself
            assert all(len(lp) == 1 and lp[0] < 0 for lp in logprobs)

        three = await call(client.generate, [[5, 6, 7]], max_tokens=3, logprobs=3)
        assert all(ids[0] == token and len(ids) == 3  # the fake's token is its own best: N entries, itself first
                   for ids, token in zip(three["logprob_token_ids"][0], three["completion_ids"][0]))


async def test_completions_logprobs_0_is_vllms_shape_whole_and_streamed(tokenizer):
    async with fake_http(tokenizer) as http:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 0, "return_tokens_as_token_ids": True}
        logprobs = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        assert logprobs["top_logprobs"] == [{token: lp} for token, lp in zip(logprobs["tokens"],
                                                                           logprobs["token_logprobs"])]
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
        tops = [top for chunk in events(streamed.text) for top in (chunk["choices"][0]["logprobs"] or {}).get(
            "top_logprobs", [])]
        assert tops == logprobs["top_logprobs"]


async def test_model_may_be_left_out_and_use_beam_search_false_is_taken(tokenizer):
    """AReaL's vLLM client (``areal/engine/vllm_remote.py``) sends no ``model`` (vLLM's field is optional) and
    ``use_beam_search: false``; beam search asked for is still refused, naming the field."""
    async with fake_http(tokenizer) as http:
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 0, "use_beam_search": False,
                "return_tokens_as_token_ids": True, "stream": False}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "tiny-llama"
        chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2, "use_beam_search": False})
        assert chat.status_code == 200 and chat.json()["model"] == "tiny-llama"
        beams = await http.post("/v1/completions", json={**body, "use_beam_search": True})
        assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"


async def test_get_server_info_has_the_logprobs_mode_grpo_trainer_reads(tokenizer, vllm_client, monkeypatch):
    """``GRPOTrainer`` in server mode reads ``get_server_info()["model_config"]["logprobs_mode"]`` and the weight
    sync ``["weight_transfer_config"]`` (``trl/trainer/grpo_trainer.py``, ``vllm_client.py``)."""
    keyed = requests.Session()
    keyed.headers.update(API)  # the fake fleet's app asks for an API key, which TRL's session does not send
    monkeypatch.setattr(trl_vllm.requests, "Session", lambda: keyed)
    async with controlled(tokenizer, HTTPOptions(weight_transfer_backend="gloo")) as s:
        client = await call(vllm_client, base_url=str(s.http.base_url))
        config = await call(client.get_server_info)
        assert config["weight_transfer_config"] == {"backend": "gloo"}
        assert config["model_config"]["logprobs_mode"] == "raw_logprobs"  # an engine that says none: vLLM's default
        assert config["model_config"]["max_logprobs"] > 0
        s.fleet.engine_info["logprobs_mode"] = "processed_logprobs"  # what the engines report (--logprobs-mode)

        async def mode() -> bool:
            return (await call(client.get_server_info))["model_config"]["logprobs_mode"] == "processed_logprobs"

        await until(mode, 10, "the engines' logprobs_mode in /server_info")


async def test_get_sequence_logprobs_ranks_every_prompt_token_as_vllm(tiny_model, tokenizer, vllm_client):
    """``get_sequence_logprobs`` sorts each position's entries by ``rank``, the actual token's among them; vLLM
    ranks every prompt token, in the top k or not (a null rank stopped TRL's sort). The actual token's rank is the
    count of tokens at least as likely, checked against the top k's log probs."""
    async with surface(tiny_model, tokenizer) as (_, http):
        client = await call(vllm_client, base_url=str(http.base_url))
        sequences = [[5, 17, 300, 42, 9, 250, 77, 3], [8, 8, 120, 64]]
        out = await call(client.get_sequence_logprobs, sequences, [2, 1], top_logprobs=2)
        assert [len(rows) for rows in out["logprobs"]] == [6, 3]
        body = {"prompt": sequences[0], "max_tokens": 1, "prompt_logprobs": 2}
        positions = (await http.post("/v1/completions", json=body)).json()["choices"][0]["prompt_logprobs"]
        outside = 0
        for position, token in zip(positions[1:], sequences[0][1:]):
            actual = position[str(token)]
            best = sorted(value["logprob"] for key, value in position.items() if key != str(token) or
                          value["rank"] <= 2)[::-1]
            assert isinstance(actual["rank"], int) and actual["rank"] >= 1
            if actual["rank"] > 2:
                outside += 1
                assert actual["logprob"] < min(best)  # below the top 2: ranked past them
        assert outside, "no prompt token fell outside the top 2: the test shows nothing"
