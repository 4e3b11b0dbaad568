"""The coordinator's request budget: a SUBMIT whose engine request would send back more log-prob entries than
``max_request_logprobs`` is refused with an ERROR that names the budget and the figure, and nothing is dispatched.

Before, a client of the coordinator (the Python API, a trainer) could ask one engine request for any product of
prompt length, tokens and log probs: its answer crossed the engine's and the client's links whole.
"""

from __future__ import annotations

import msgspec

from megatron_serve.limits import DEFAULT_MAX_REQUEST_LOGPROBS
from megatron_serve.wire.messages import Submit
from megatron_serve.wire.protocol import ErrorCode, Header

from .core_harness import CoreHarness

C, E1 = b"client", b"engine-1"


def submit(h: CoreHarness, crid: str, prompt_len: int, **params: object) -> None:
    h.send(C, Header.SUBMIT, Submit(client_request_id=crid, prompt=[1] * prompt_len,
                                    sampling_params=msgspec.Raw(msgspec.msgpack.encode(params))))


def test_a_submit_over_the_log_prob_budget_is_refused_with_its_figure():
    h = CoreHarness(max_request_logprobs=10_000)
    h.client(C)
    h.engine(E1, group=0, capacity=4)
    # 999 prompt positions x 21 + 16 tokens x 21 = 21,315 entries
    submit(h, "big", 1000, num_tokens_to_generate=16, top_n_logprobs=20, return_log_probs=True,
           return_prompt_log_probs=True)
    error = h.take(C, Header.ERROR)[0]
    assert error.code == ErrorCode.INVALID_REQUEST.value and error.client_request_id == "big"
    assert "21,315 log probs" in error.message and "10,000" in error.message
    assert "--max-request-logprobs" in error.message
    assert h.core.flow.table.get("c1/big") is None and not h.take(E1, Header.ENGINE_SUBMIT)
    submit(h, "within", 400, num_tokens_to_generate=16, top_n_logprobs=20, return_prompt_log_probs=True)
    assert h.take(E1, Header.ENGINE_SUBMIT)[0].request["request_id"].endswith("within")


def test_the_default_budget_takes_a_long_prompt_scored_with_twenty_alternatives():
    h = CoreHarness()
    assert h.core.flow.max_request_logprobs == DEFAULT_MAX_REQUEST_LOGPROBS
    h.client(C)
    h.engine(E1, group=0, capacity=4)
    submit(h, "scoring", 32_000, num_tokens_to_generate=1, top_n_logprobs=20, return_prompt_log_probs=True)
    assert h.take(E1, Header.ENGINE_SUBMIT)
