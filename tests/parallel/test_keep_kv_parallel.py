"""Suspend with ``keep_kv`` in a group of ranks (gloo on CPU, a process per rank): every rank parks its own part of
the live requests' blocks (a pipeline stage its layers', a tensor-parallel rank its KV heads'), so that requests
through suspend and resume end as uninterrupted ones (``==``) with no token computed twice.

Before every rank parked, a follower released its pool and resumed over a zeroed one: the requests went on over
its garbage KV (at two pipeline stages, the second stage's layers attended to zeros)."""

from __future__ import annotations

import random

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import run_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a process per rank, as the other group tests

BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True, return_log_probs=True)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    # 4 layers (2 per stage), 2 KV heads (1 per tensor-parallel rank)
    return str(make_tiny_model(tmp_path_factory.mktemp("keep-kv-pp"), seed=3, num_layers=4, num_heads=4,
                               num_kv_heads=2))


def run(engine, suspend=None) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Step three prompts to their end, with ``suspend(engine)`` after three steps; returns their tokens and log
    probs, and the tokens the engine computed meanwhile."""
    rng = random.Random(7)
    requests = [DynamicInferenceRequest(str(i), "", [rng.randrange(5, 500) for _ in range(2 * BLOCK + 3 + i)], PARAMS)
                for i in range(3)]
    computed = engine.load().computed_tokens
    run_steps(engine, requests, 3)
    engine.sync()
    if suspend is not None:
        suspend(engine)
    while engine.has_unfinished_requests():
        engine.step()
    return [(r.generated_tokens, r.generated_log_probs) for r in requests], engine.load().computed_tokens - computed


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
                         ids=["pp2", "tp2"])
def test_a_group_suspended_with_keep_kv_resumes_as_if_uninterrupted(dense, layout):
    # no prefix caching: the second run finds nothing of the first, each computes its own prompts
    config = InferenceConfig(dtype="float32", device="cpu", block_size_tokens=BLOCK, num_kv_blocks=32,
                             enable_prefix_caching=False, **layout)
    with MegatronLLM(dense, config) as llm:
        engine = llm.engine
        uninterrupted, computed = run(engine)

        def keep(served) -> None:
            assert served.memory.suspend(keep_kv=True) > 0  # this rank's pool released
            assert served.memory.kept_kv_bytes > 0
            served.memory.resume()

        kept, kept_computed = run(engine, keep)
        assert kept == uninterrupted
        assert kept_computed == computed  # not one token computed twice, on any rank

        plain, plain_computed = run(engine, lambda served: (served.memory.suspend(), served.memory.resume()))
        # the control: the same tokens (log probs within rounding: contexts prefilled, not decoded), every context
        # computed again
        assert [tokens for tokens, _ in plain] == [tokens for tokens, _ in uninterrupted]
        assert plain_computed > computed
