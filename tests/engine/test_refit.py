"""In-place weight refit: verified before touching live weights, epochs recorded per token."""

from __future__ import annotations

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import PROMPTS, run_steps

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit")
    return (str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1)),
            str(make_tiny_model(root / "wide", seed=2, hidden_size=96)))


def outputs(model_dir: str):
    return [o.generated_tokens for o in MegatronLLM(model_dir).generate(PROMPTS, GREEDY)]


def test_refit_switches_weights_and_in_flight_requests_show_the_switch(checkpoints):
    a, b, _ = checkpoints
    expected_a, expected_b = outputs(a), outputs(b)
    assert expected_a != expected_b
    llm = MegatronLLM(a)
    engine = llm.engine
    in_flight = [DynamicInferenceRequest(f"old{i}", p, llm.tokenizer.encode(p), GREEDY) for i, p in enumerate(PROMPTS)]
    run_steps(engine, in_flight, 4)
    timings = engine.memory.refit(b, epoch=7)
    assert timings["epoch"] == 7 and timings["total_s"] >= timings["load_s"] > 0
    while engine.has_unfinished_requests():
        engine.step()
    for request in in_flight:
        assert request.policy_epochs[0] == 0 and request.policy_epochs[-1] == 7
        assert len(request.policy_epochs) == len(request.kv_epochs) == len(request.generated_tokens)
        assert set(request.kv_epochs) == {0}  # their KV was computed before the refit
    assert [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)] == expected_b
    fresh = llm.generate(PROMPTS[0], GREEDY)[0]
    assert set(fresh.policy_epochs) == set(fresh.kv_epochs) == {7}


def test_refit_to_a_different_shape_fails_and_keeps_serving(checkpoints):
    a, _, wide = checkpoints
    expected_a = outputs(a)
    llm = MegatronLLM(a)
    with pytest.raises(ValueError, match="hidden_size is 96 but the serving model has 64"):
        llm.engine.memory.refit(wide)
    assert llm.engine.epoch == 0
    assert [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)] == expected_a


def test_refit_forgets_prefix_cache_of_old_weights(checkpoints):
    a, b, _ = checkpoints
    llm = MegatronLLM(a, InferenceConfig(enable_prefix_caching=True, block_size_tokens=4))
    prompt = llm.tokenizer.encode(PROMPTS[6])
    llm.generate([prompt], GREEDY)
    assert llm.engine.allocator.num_cached > 0
    llm.engine.memory.refit(b)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 0
    assert out.generated_tokens == MegatronLLM(b).generate([prompt], GREEDY)[0].generated_tokens


def test_megatron_llm_refit_in_direct_mode(checkpoints):
    a, b, wide = checkpoints
    with MegatronLLM(a) as llm:
        answer = llm.refit(b)
        assert answer["detail"]["epoch"] == 1 and answer["detail"]["source"] == b
        assert answer["detail"]["engines"]["local"]["load_s"] > 0
        assert [o.generated_tokens for o in llm.generate(PROMPTS[:2], GREEDY)] == outputs(b)[:2]
        with pytest.raises(ValueError, match="hidden_size is 96"):
            llm.refit(wide, epoch=9)
        assert llm.engine.epoch == 1


async def test_async_llm_refit_in_direct_mode_between_steps(checkpoints):
    from megatron_serve import MegatronAsyncLLM
    from megatron_serve.client.coordinator_client import StreamPartial

    a, b, wide = checkpoints
    long = SamplingParams(temperature=0.0, num_tokens_to_generate=64, ignore_eos=True)
    async with MegatronAsyncLLM(a) as llm:
        stream = llm.generate_stream(PROMPTS[1], long)
        first = await stream.__anext__()
        assert isinstance(first, StreamPartial)
        answer = await llm.refit(b, epoch=3)
        assert answer["detail"]["epoch"] == 3
        async for item in stream:
            final = item
        assert final.policy_epochs[0] == 0 and final.policy_epochs[-1] == 3
        with pytest.raises(ValueError, match="hidden_size is 96"):
            await llm.refit(wide)
        fresh = await llm.generate(PROMPTS[0], GREEDY)
        assert set(fresh.policy_epochs) == {3}


def test_a_continuation_without_epochs_gets_unknown_ones(checkpoints):
    """A request resubmitted with tokens whose epochs were not kept (-1) still has one entry per token.
    (The coordinator's side, mirroring the epochs engines report: tests/coordinator/test_core.py.)"""
    a, _, _ = checkpoints
    llm = MegatronLLM(a)
    request = DynamicInferenceRequest("moved", PROMPTS[0], llm.tokenizer.encode(PROMPTS[0]), GREEDY,
                                      generated_tokens=[5, 6, 7], policy_epochs=[0], kv_epochs=[0])
    llm.engine.add_request(request)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    n = len(request.generated_tokens)
    assert request.policy_epochs[:3] == request.kv_epochs[:3] == [-1, -1, 0]
    assert len(request.policy_epochs) == len(request.kv_epochs) == n and set(request.policy_epochs[3:]) == {0}
