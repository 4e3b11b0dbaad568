"""Per-request sampling streams keyed on (seed, sample index, position), and ``--logprobs-mode``."""

from __future__ import annotations

import math
import random

import pytest

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.engine import DynamicInferenceEngine

from ..prompts import PROMPTS, run_requests


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16))


def random_others(seed: int, count: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    return [(rng.choice(PROMPTS), SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 5]),
                                                 top_p=rng.choice([1.0, 0.8]), num_tokens_to_generate=rng.randint(2, 20),
                                                 ignore_eos=True, seed=rng.choice([None, 3])))
            for _ in range(count)]


def test_a_seeded_request_samples_the_same_alone_and_in_any_batch_and_its_n_samples_differ(engine, tiny_llama):
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=2024, n=4, num_tokens_to_generate=16, ignore_eos=True)
    choices = [(PROMPTS[2], params) for params in target.choices()]
    alone = [r.generated_tokens for r in run_requests(engine, choices)]
    for batch_seed in (1, 2):
        others = random_others(batch_seed, 9)
        mixed = run_requests(engine, others[:4] + choices + others[4:])
        assert [r.generated_tokens for r in mixed[4:8]] == alone
    assert len({tuple(tokens) for tokens in alone}) == 4  # sample i of n draws its own stream
    other_engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16, seed=99))
    assert [r.generated_tokens for r in run_requests(other_engine, choices)] == alone  # reruns reproduce
    reseeded = [(PROMPTS[2], params) for params in SamplingParams(
        temperature=1.0, top_p=0.95, seed=2025, n=4, num_tokens_to_generate=16, ignore_eos=True).choices()]
    assert [r.generated_tokens for r in run_requests(engine, reseeded)] != alone  # the control: the seed matters


def test_unseeded_requests_get_their_own_seeds(engine):
    unseeded = SamplingParams(temperature=1.0, num_tokens_to_generate=16, ignore_eos=True)
    results = run_requests(engine, [(PROMPTS[2], unseeded)] * 4)
    assert len({tuple(r.generated_tokens) for r in results}) == 4


MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
TEMPERATURE, TOP_K, BIAS_TOKEN, BIAS = 0.5, 3, 40, 1.5


@pytest.fixture(scope="module")
def by_mode(tiny_llama) -> dict[str, list]:
    """One seeded request with temperature, top-k, a logit bias and 5 top log probs, under each mode."""
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, logit_bias={BIAS_TOKEN: BIAS}, seed=7,
                            num_tokens_to_generate=12, ignore_eos=True, return_log_probs=True, top_n_logprobs=5)
    results = {}
    for mode in MODES:
        engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16,
                                                                                   logprobs_mode=mode))
        (request,) = run_requests(engine, [(PROMPTS[1], params)])
        results[mode] = request
    return results


def test_every_logprobs_mode_samples_the_same_tokens(by_mode):
    tokens = [r.generated_tokens for r in by_mode.values()]
    assert all(t == tokens[0] for t in tokens) and len(tokens[0]) == 12


def test_raw_logprobs_are_the_log_softmax_of_raw_logits(by_mode):
    for logprobs, logits in zip(by_mode["raw_logprobs"].generated_top_n_logprobs,
                                by_mode["raw_logits"].generated_top_n_logprobs):
        assert list(logprobs) == list(logits)  # the same ranking
        shifts = [logits[t] - logprobs[t] for t in logits]  # logsumexp of the row: the same for every token
        assert max(shifts) - min(shifts) == pytest.approx(0.0, abs=1e-4)
    assert all(p <= 0 for p in by_mode["raw_logprobs"].generated_log_probs)


def test_processed_values_come_after_bias_temperature_and_top_k(by_mode):
    raw_logits = by_mode["raw_logits"]
    for position, (processed, raw) in enumerate(zip(by_mode["processed_logits"].generated_top_n_logprobs,
                                                    raw_logits.generated_top_n_logprobs)):
        kept = [t for t, v in processed.items() if v != -math.inf]
        assert len(kept) == TOP_K  # top-k drops the rest: they read -inf
        for token in kept:
            if token in raw:
                expected = (raw[token] + (BIAS if token == BIAS_TOKEN else 0.0)) / TEMPERATURE
                assert processed[token] == pytest.approx(expected, rel=1e-5), position
    for top in by_mode["processed_logprobs"].generated_top_n_logprobs:
        finite = [v for v in top.values() if v != -math.inf]
        assert len(finite) == TOP_K and sum(math.exp(v) for v in finite) == pytest.approx(1.0, abs=1e-5)
    # the control: the raw log probs are not renormalised over the top k
    assert any(sum(math.exp(v) for v in list(top.values())[:TOP_K]) < 0.999
               for top in by_mode["raw_logprobs"].generated_top_n_logprobs)


def test_the_engine_option_reaches_the_config_and_a_bad_mode_is_refused():
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--logprobs-mode", "processed_logits"])
    assert inference_config_from_args(args).logprobs_mode == "processed_logits"
    with pytest.raises(SystemExit):
        parser.parse_args(["--logprobs-mode", "softmax"])
    with pytest.raises(ValueError, match="logprobs_mode"):
        InferenceConfig(logprobs_mode="softmax")
