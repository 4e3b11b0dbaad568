"""The coordinator counts a request's kept ids (``return_top_p_token_ids``) in its ``--max-request-logprobs`` budget,
bounded by the vocabulary its engines report in their HELLO: top-p alone on 16 tokens of a 150,000-id vocabulary asks
up to 2.4 million, and is refused before it is queued; with top_k 40, or greedy, it is dispatched. A real engine's
HELLO carries its vocabulary."""

from __future__ import annotations

import msgspec

from megatron_serve import InferenceConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.config import ModelConfig
from megatron_serve.wire.messages import Submit
from megatron_serve.wire.protocol import Header

from .core_harness import CoreHarness

C, E1 = b"client", b"engine-1"
NUCLEUS = {"num_tokens_to_generate": 16, "temperature": 0.8, "top_p": 0.9, "return_top_p_token_ids": True}


def _submit(h: CoreHarness, crid: str, params: dict) -> None:
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3],
                                    sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))


def test_kept_ids_count_in_the_budget_at_the_engines_vocabulary():
    h = CoreHarness()
    h.client(C)
    h.engine(E1, vocab_size=150_000)
    _submit(h, "nucleus", NUCLEUS)
    refused = h.take(C, Header.ERROR)
    assert [e.client_request_id for e in refused] == ["nucleus"]
    assert "2,400,000 top-p token ids" in refused[0].message and "--max-request-logprobs" in refused[0].message
    assert not h.take(E1, Header.ENGINE_SUBMIT)
    for crid, params in (("top-k", {**NUCLEUS, "top_k": 40}), ("greedy", {**NUCLEUS, "temperature": 0.0}),
                         ("no-flag", {**NUCLEUS, "return_top_p_token_ids": False})):
        _submit(h, crid, params)
    assert not h.take(C, Header.ERROR)
    assert [s.request["request_id"] for s in h.take(E1, Header.ENGINE_SUBMIT)] == ["c1/top-k", "c1/greedy",
                                                                                  "c1/no-flag"]


def test_an_engines_hello_carries_its_vocabulary(tiny_model):
    engine = DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(dtype="float32", num_kv_blocks=8))
    assert engine.facts().hello_info()["vocab_size"] == ModelConfig.from_dir(tiny_model).vocab_size
