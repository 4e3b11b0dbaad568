"""The coordinator counts a request's kept ids (``return_top_p_token_ids``) in its ``--max-request-logprobs`` budget:
up front where their most is known (``top_k`` per new token), as its engine produces them otherwise. Top-p alone on
1,024 tokens of a 151,936-id vocabulary (slime's defaults) is dispatched, where counting the vocabulary per token
refused it; top_k 40 on 16 tokens past a budget of 600 is refused before it is queued. A request whose real kept ids
pass the budget ends at once after the step that passed it: its client has the tokens so far and a FAILED result
(reason ``length``) naming the cap, its engine is told to drop it, and the next request is served. A real engine's
HELLO carries its vocabulary."""

from __future__ import annotations

import msgspec

from megatron_serve import InferenceConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.config import ModelConfig
from megatron_serve.wire.deltas import EngineStep, RequestDelta
from megatron_serve.wire.messages import Submit
from megatron_serve.wire.protocol import Header
from megatron_serve.wire.submission import Result

from .core_harness import ClientDelta, CoreHarness
from .test_core import final_record

C, E1 = b"client", b"engine-1"
NUCLEUS = {"num_tokens_to_generate": 16, "temperature": 0.8, "top_p": 0.9, "return_top_p_token_ids": True}


def _submit(h: CoreHarness, crid: str, params: dict) -> None:
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1, 2, 3],
                                    sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))


def _step(h: CoreHarness, engine: str, request_id: str, token: int, kept: list[int], record: dict | None = None) -> None:
    out = RequestDelta(request_id=request_id, new_tokens=[token], finished=record is not None, top_p_token_ids=[kept])
    records = {} if record is None else {request_id: msgspec.Raw(msgspec.msgpack.encode(record))}
    h.send(E1, Header.ENGINE_STEP, EngineStep(engine_id=engine, records=records,
                                              outputs=[msgspec.Raw(msgspec.msgpack.encode(out))]))


def test_top_p_alone_is_dispatched_and_top_k_past_the_budget_is_refused_up_front():
    h = CoreHarness(max_request_logprobs=600)
    h.client(C)
    h.engine(E1, vocab_size=151_936)
    _submit(h, "slime-default", {**NUCLEUS, "num_tokens_to_generate": 1024})
    _submit(h, "top-k", {**NUCLEUS, "top_k": 40})  # 640 ids at most
    refused = h.take(C, Header.ERROR)
    assert [e.client_request_id for e in refused] == ["top-k"]
    assert "640 top-p token ids" in refused[0].message and "budget of 600" in refused[0].message
    assert "--max-request-logprobs" in refused[0].message
    for crid, params in (("top-k-within", {**NUCLEUS, "top_k": 30}), ("greedy", {**NUCLEUS, "temperature": 0.0})):
        _submit(h, crid, params)
    assert not h.take(C, Header.ERROR)
    assert [s.request["request_id"] for s in h.take(E1, Header.ENGINE_SUBMIT)] == [
        "c1/slime-default", "c1/top-k-within", "c1/greedy"]


def test_kept_ids_past_the_budget_as_produced_end_the_request_and_the_next_is_served():
    h = CoreHarness(max_request_logprobs=250)
    h.client(C)
    engine = h.engine(E1)
    _submit(h, "wide", NUCLEUS)
    assert h.take(E1, Header.ENGINE_SUBMIT)  # top-p alone: nothing to refuse up front
    _step(h, engine, "c1/wide", 11, list(range(100)))
    _step(h, engine, "c1/wide", 12, list(range(100)))
    assert not h.take(C, Header.RESULT) and not h.take(E1, Header.ABORT)  # 200 of 250: going on
    _step(h, engine, "c1/wide", 13, list(range(100)))  # 300: past the budget
    received = h.take(C)
    deltas = [b for b in received if isinstance(b, ClientDelta)]
    assert [t for d in deltas for t in d.new_tokens] == [11, 12, 13]  # the tokens so far, then the end
    (result,) = [b for b in received if isinstance(b, Result)]
    assert received.index(result) > received.index(deltas[-1])
    final = result.request
    assert (final["status"], final["finish_reason"]) == ("FAILED", "length")
    assert "budget of 250 per request (--max-request-logprobs)" in final["error"]
    assert "300 top-p token ids in 3 new tokens" in final["error"]
    assert [a.request_id for a in h.take(E1, Header.ABORT)] == ["c1/wide"]  # the engine stops computing it
    _step(h, engine, "c1/wide", 14, list(range(100)))  # a step already in flight: never delivered
    assert not h.take(C)

    _submit(h, "next", NUCLEUS)  # the fleet serves the next request
    (submitted,) = h.take(E1, Header.ENGINE_SUBMIT)
    _step(h, engine, "c1/next", 21, [21, 22], final_record(submitted.request, [21]))
    (done,) = h.take(C, Header.RESULT)
    assert done.request["status"] == "COMPLETED"


def test_an_engines_hello_carries_its_vocabulary(tiny_model):
    engine = DynamicInferenceEngine.from_model_dir(tiny_model, InferenceConfig(dtype="float32", num_kv_blocks=8))
    assert engine.facts().hello_info()["vocab_size"] == ModelConfig.from_dir(tiny_model).vocab_size


def _resubmitted(kept_ids: int | None) -> tuple[CoreHarness, str]:
    """A coordinator that has just started again (a fresh core) and its engine, the client's request resubmitted to go
    on from its two tokens (its 200 kept ids delivered before), ``kept_ids`` as the client counts them (None: as
    before, not sent), dispatched again."""
    h = CoreHarness(max_request_logprobs=250)
    h.client(C)
    engine = h.engine(E1)
    h.send(C, Header.SUBMIT, Submit(client_request_id="wide", prompt=[1, 2, 3], generated_tokens=[11, 12],
                                    kept_ids=kept_ids, sampling_params=msgspec.Raw(msgspec.msgpack.encode(NUCLEUS))))
    assert h.take(E1, Header.ENGINE_SUBMIT)
    return h, engine


def test_a_resubmission_after_a_coordinator_restart_goes_on_counting_the_ids_delivered_before():
    """The ids a client already has stay counted when the request is submitted again (the client sends their count
    with its tokens: tests/client/test_kept_ids_meter.py): 100 more pass the budget of 250. The control, the same
    resubmission without the count: the coordinator's count starts again at 0, and the request goes on."""
    h, engine = _resubmitted(kept_ids=200)
    _step(h, engine, "c1/wide", 13, list(range(100)))
    (result,) = h.take(C, Header.RESULT)
    assert (result.request["status"], result.request["finish_reason"]) == ("FAILED", "length")
    assert "300 top-p token ids in 3 new tokens" in result.request["error"]
    assert [a.request_id for a in h.take(E1, Header.ABORT)] == ["c1/wide"]

    control, engine = _resubmitted(kept_ids=None)
    _step(control, engine, "c1/wide", 13, list(range(100)))
    assert not control.take(C, Header.RESULT) and not control.take(E1, Header.ABORT)
