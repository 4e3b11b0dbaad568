"""Speculative decoding with the n-gram proposer: the output is the target's, token for token and log prob for log prob.

Every comparison runs the same requests through an engine without speculation and one with it, and checks that
drafts were really accepted. The tiny random model does not repeat itself; a logit bias toward a few tokens per
request makes its output a mix of them in the model's own order, which prompt lookup predicts in part (about 1 in 6
tokens), so acceptance is real and neither none nor all.
"""

from __future__ import annotations

import random

import pytest
from msgspec.structs import replace

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.wire.request import FinishReason
from ..prompts import run_to_end

# K pinned (adaptive off): these tests assert that drafts were proposed and accepted, which the adaptive policy
# may rightly decline on a tiny CPU model (tests/engine/test_speculative_adaptive.py covers it)
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                         adaptive=False)


def engine_for(model: str, speculative: bool, **kwargs) -> DynamicInferenceEngine:
    config = InferenceConfig(block_size_tokens=16, speculative=SPEC if speculative else None, **kwargs)
    return DynamicInferenceEngine.from_model_dir(model, config)


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase (what prompt lookup feeds on) with some noise around it."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 500) for _ in range(rng.randint(2, 5))]
        prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(0, 4))] + phrase * rng.randint(2, 5))
    return prompts


def looping(rng: random.Random, **kwargs) -> SamplingParams:
    """Greedy (unless told) parameters whose logit bias favours 2-4 tokens: output that repeats, in the model's order."""
    bias = {rng.randrange(3, 500): rng.uniform(4.0, 8.0) for _ in range(rng.randint(2, 4))}
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "logit_bias": bias, **kwargs})


def run(engine: DynamicInferenceEngine, prompts: list[list[int]], params: list[SamplingParams]
        ) -> list[DynamicInferenceRequest]:
    requests = [DynamicInferenceRequest(f"r{i}", None, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    return run_to_end(engine, requests)


def outputs(requests: list[DynamicInferenceRequest]) -> list[tuple]:
    return [(r.generated_tokens, r.generated_log_probs, r.generated_top_n_logprobs, r.finish_reason)
            for r in requests]


@pytest.fixture(scope="module")
def invariant_pair(tiny_llama):
    """Engines in batch-invariant mode: a row's logits do not depend on how many query rows share its step,
    so the verify rows' log probs are the decode rows' bit for bit."""
    return engine_for(tiny_llama, False, batch_invariant=True), engine_for(tiny_llama, True, batch_invariant=True)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return engine_for(tiny_llama, False), engine_for(tiny_llama, True)


@pytest.mark.parametrize("case", range(3))
def test_greedy_output_and_log_probs_are_bitwise_those_without_speculation(invariant_pair, case):
    plain, spec = invariant_pair
    rng = random.Random(case)
    prompts = repetitive_prompts(case, 4)
    params = [looping(rng, num_tokens_to_generate=rng.randint(20, 48), return_log_probs=True,
                      top_n_logprobs=rng.choice([0, 3])) for _ in prompts]
    accepted = spec.stats.counters["spec_decode_num_accepted_tokens"]
    assert outputs(run(spec, prompts, params)) == outputs(run(plain, prompts, params))
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > accepted  # drafts were accepted, not only proposed


def test_default_mode_tokens_equal_and_log_probs_within_rounding(pair):
    """Without batch invariance a verify row runs as a prefill-shaped row: the same tokens, log probs within
    float32 rounding (measured: at most 4.8e-7 apart)."""
    plain, spec = pair
    prompts = repetitive_prompts(7, 4)
    rng = random.Random(7)
    params = [looping(rng, num_tokens_to_generate=40, return_log_probs=True) for _ in prompts]
    accepted = spec.stats.counters["spec_decode_num_accepted_tokens"]
    with_spec, without = run(spec, prompts, params), run(plain, prompts, params)
    for a, b in zip(with_spec, without):
        assert a.generated_tokens == b.generated_tokens
        assert a.generated_log_probs == pytest.approx(b.generated_log_probs, abs=1e-5)
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > accepted


def test_kept_ids_of_verified_rows_are_the_plain_engines(invariant_pair):
    """return_top_p_token_ids: a verify step's rows report each emitted token's kept ids as the plain engine's steps
    do (the accepted drafts' and the bonus token's), with the log probs renormalized over them."""
    plain, spec = invariant_pair
    prompts = repetitive_prompts(12, 2)
    params = [SamplingParams(temperature=0.8, top_p=0.6, seed=3, num_tokens_to_generate=32, ignore_eos=True,
                             logit_bias={7: 5.0, 70: 5.0}, return_log_probs=True, return_top_p_token_ids=True)] * 2
    accepted = spec.stats.counters["spec_decode_num_accepted_tokens"]
    got = run(spec, prompts, params)
    want = run(plain, prompts, params)
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > accepted
    assert outputs(got) == outputs(want)
    assert [r.generated_top_p_token_ids for r in got] == [r.generated_top_p_token_ids for r in want]
    assert all(len(r.generated_top_p_token_ids) == 32 for r in got)


def test_seeded_sampling_with_penalties_and_n_samples_is_the_plain_engines(invariant_pair):
    """Verification draws each position from the engine's own seeded stream, so a seeded sampled request emits what
    it emits without speculation: rejection sampling for point-mass drafts, reproducible by construction."""
    plain, spec = invariant_pair
    prompts = repetitive_prompts(11, 2)
    base = SamplingParams(temperature=0.8, top_k=20, seed=5, n=3, num_tokens_to_generate=40, ignore_eos=True,
                          frequency_penalty=0.2, presence_penalty=0.1, logit_bias={7: 5.0, 70: 5.0, 170: 4.0},
                          return_log_probs=True, top_n_logprobs=2)
    params = base.choices()
    jobs = [p for p in prompts for _ in params]
    all_params = params * len(prompts)
    accepted = spec.stats.counters["spec_decode_num_accepted_tokens"]
    got = outputs(run(spec, jobs, all_params))
    assert got == outputs(run(plain, jobs, all_params))
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > accepted
    assert len({tuple(o[0]) for o in got[:3]}) == 3  # the n samples differ
    reseeded = [replace(p, seed=6) for p in all_params]
    assert outputs(run(spec, jobs, reseeded)) != got  # the control: the seed matters


@pytest.mark.parametrize("logprobs_mode", ["processed_logprobs", "raw_logits"])
def test_logprobs_modes_with_speculation(tiny_llama, logprobs_mode):
    prompts = repetitive_prompts(3, 3)
    rng = random.Random(3)
    params = [looping(rng, temperature=0.7, seed=1, num_tokens_to_generate=32, return_log_probs=True,
                      top_n_logprobs=2) for _ in prompts]
    plain = engine_for(tiny_llama, False, batch_invariant=True, logprobs_mode=logprobs_mode)
    spec = engine_for(tiny_llama, True, batch_invariant=True, logprobs_mode=logprobs_mode)
    assert outputs(run(spec, prompts, params)) == outputs(run(plain, prompts, params))
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > 0


def test_max_tokens_and_stop_tokens_end_mid_acceptance(invariant_pair):
    """A length limit never lets drafts run past it, and a stop token among accepted tokens ends the request there."""
    plain, spec = invariant_pair
    prompts = repetitive_prompts(5, 4)
    rng = random.Random(5)
    loops = [looping(rng, num_tokens_to_generate=48, return_log_probs=True) for _ in prompts]
    free = run(plain, prompts, loops)
    params = []
    for request, loop in zip(free, loops):  # the 13th token stops it (at its first occurrence, maybe earlier)
        params.append(replace(loop, stop_token_ids=[request.generated_tokens[12]]))
    for lengths in ([5, 9, 13, 17], [1, 2, 3, 47]):
        params += [replace(loop, num_tokens_to_generate=n) for n, loop in zip(lengths, loops)]
    jobs = prompts + prompts * 2
    got = run(spec, jobs, params)
    assert outputs(got) == outputs(run(plain, jobs, params))
    assert [r.finish_reason for r in got[:4]] == [FinishReason.STOP] * 4
    assert [len(r.generated_tokens) for r in got[4:]] == [5, 9, 13, 17, 1, 2, 3, 47]


def test_preemption_with_a_tiny_pool_and_prefix_caching(tiny_llama):
    """Drafts need KV rows: a pool of 12 blocks of 4 tokens preempts; outputs stay those of the plain engine."""
    kwargs = dict(batch_invariant=True, block_size_tokens=4, num_kv_blocks=12, max_batch_tokens=32)
    plain = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(**kwargs))
    spec = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(speculative=SPEC, **kwargs))
    prompts = repetitive_prompts(21, 5)
    prompts[1] = prompts[0][:8] + prompts[1]  # a shared prefix: prefix-cache hits
    rng = random.Random(21)
    params = [looping(rng, num_tokens_to_generate=20, return_log_probs=True) for _ in prompts]
    got = run(spec, prompts, params)
    assert outputs(got) == outputs(run(plain, prompts, params))
    assert spec.stats.counters["num_preemptions"] > 0
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > 0
    assert spec.load().kv_blocks_free == spec.load().kv_blocks_total  # every block came back, rolled-back ones included


def test_drafts_are_never_published_to_the_prefix_cache(tiny_llama):
    """After a run, every cached block's tokens are a prefix of some request's verified tokens."""
    spec = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=4, speculative=SPEC))
    prompts = repetitive_prompts(2, 3)
    rng = random.Random(2)
    requests = run(spec, prompts, [looping(rng, num_tokens_to_generate=30) for _ in prompts])
    assert spec.stats.counters["spec_decode_num_draft_tokens"] > spec.stats.counters["spec_decode_num_accepted_tokens"] > 0
    from megatron_serve.wire.prefix_hash import ROOT_HASH, block_hashes  # noqa: PLC0415

    verified = set()
    for request in requests:
        verified.update(block_hashes(request.prompt_tokens + request.generated_tokens, 4, ROOT_HASH))
    cached = set(spec.allocator._block_of_hash)  # noqa: SLF001 - the cache's own index is what is checked
    assert cached and cached <= verified
