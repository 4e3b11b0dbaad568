"""``--batch-invariant`` across the verbs and the fleet: a request suspended and resumed mid-generation, and
copies of one request served by either of two data-parallel engines behind the coordinator, keep the
log probs the request gets alone in a lone engine, bitwise. The controls: without the mode the same runs
change float32 log probs (a suspended request is recomputed as a prefill; a batch changes the GEMM shapes).
"""

from __future__ import annotations

import random

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine

from .runs import TARGET_TOKENS, Setup, differing, run_target, target_params, target_prompt

COPIES = 4  # copies of the target among the fleet's traffic: least-loaded routing spreads them over both engines


def _others(count: int) -> list[DynamicInferenceRequest]:
    rng = random.Random(count)
    return [DynamicInferenceRequest(f"other-{i}", None, [rng.randrange(5, 500) for _ in range(rng.randrange(3, 60))],
                                    SamplingParams(temperature=1.0, seed=i, ignore_eos=True,
                                                   num_tokens_to_generate=rng.randrange(4, 24)))
            for i in range(count)]


def _suspended_mid_request(model_dir: str, invariant: bool) -> list[float]:
    """The target among 7 others; after 6 steps the engine suspends (its KV pool is released, every request
    goes back to the queue) and resumes; the target's prompt and tokens so far are computed again."""
    engine = DynamicInferenceEngine.from_model_dir(
        model_dir, InferenceConfig(dtype="float32", device="cpu", batch_invariant=invariant, block_size_tokens=16))
    try:
        target = DynamicInferenceRequest("target", None, target_prompt(), target_params(False))
        for request in [*_others(7), target]:
            engine.add_request(request)
        for _ in range(6):
            engine.step()
        assert 0 < len(target.generated_tokens) < TARGET_TOKENS, "the suspend is not mid-generation"
        assert engine.memory.suspend(1) > 0, "the suspend released nothing"
        engine.memory.resume()
        while engine.has_unfinished_requests():
            engine.step()
        return target.generated_log_probs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("invariant", [True, False])
def test_a_request_suspended_and_resumed_mid_generation_keeps_its_log_probs(models, invariant):
    alone = run_target(models["llama"], "float32", invariant, Setup())
    resumed = _suspended_mid_request(models["llama"], invariant)
    if invariant:
        assert resumed == alone.log_probs
    else:
        assert differing(resumed, alone.log_probs), "the control does not differ without the mode"


@pytest.mark.parametrize("invariant", [True, False])
def test_copies_served_by_two_engines_behind_the_coordinator_equal_the_lone_run(models, invariant):
    alone = run_target(models["llama"], "float32", invariant, Setup())
    config = InferenceConfig(dtype="float32", device="cpu", batch_invariant=invariant, block_size_tokens=16)
    llm = MegatronLLM(models["llama"], config, use_coordinator=True, num_engines=2)
    try:
        others = _others(8)
        prompts = [r.prompt_tokens for r in others[:4]] + [target_prompt()] * COPIES + [r.prompt_tokens
                                                                                         for r in others[4:]]
        params = ([r.sampling_params for r in others[:4]] + [target_params(False)] * COPIES
                  + [r.sampling_params for r in others[4:]])
        results = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    copies = results[4:4 + COPIES]
    mismatched = [differing(c.generated_log_probs, alone.log_probs) for c in copies]
    if invariant:
        assert mismatched == [0] * COPIES, f"log probs that differ from the lone run, per copy: {mismatched}"
        assert [c.generated_tokens for c in copies] == [alone.tokens] * COPIES
    else:
        assert any(mismatched), "the control does not differ without the mode"
