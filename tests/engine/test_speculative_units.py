"""Speculative decoding's parts alone: prompt lookup, the config's checks, the verifier's distribution, the counters."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_serve import InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine.sampling.sampler import Sampler
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.engine.sequence import Sequence
from megatron_serve.engine.speculative.decoder import Speculator
from megatron_serve.engine.speculative.factory import make_proposer
from megatron_serve.engine.speculative.ngram import NgramProposer, lookup
from megatron_serve.engine.speculative.proposer import DraftInput
from megatron_serve.wire.engine_stats import EngineStats
from megatron_serve.wire.request import EngineRequest


@pytest.mark.parametrize(("tokens", "n_min", "n_max", "count", "expected"), [
    ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),  # suffix [1, 2] found at the start: what followed it
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 1, 3, 5, [3, 4, 1, 2]),  # no match of [4, 1, 2] has 5 after it: the earliest
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 1, 3, 2, [3, 4]),  # the latest match that 2 tokens follow
    ([7, 7, 7, 7, 7, 7], 1, 3, 3, [7, 7, 7]),  # a run: not the latest match (one token after it) but one with 3
    ([9, 1, 2, 7, 5, 1, 2, 8, 1, 2], 3, 3, 2, []),  # no 3-token match
    ([9, 1, 2, 7, 5, 1, 2, 8, 1, 2], 2, 3, 2, [8, 1]),  # the 2-token suffix's latest match wins
    ([5, 6, 7], 1, 3, 2, []),  # nothing repeats
    ([4, 4], 1, 3, 3, [4]),
    ([1, 5, 2, 9, 1, 5, 2, 8, 8, 1, 5, 2], 3, 3, 2, [8, 8]),  # the latest of two full matches
    ([1, 2, 1], 1, 1, 0, []),  # nothing asked
])
def test_prompt_lookup(tokens, n_min, n_max, count, expected):
    assert lookup(tokens, n_min, n_max, count) == expected


def test_prompt_lookup_agrees_with_a_scan_of_every_window():
    """The lookup compares suffixes only where the last token occurred before; a scan of every earlier window of
    each length gives the same answer on random token lists (a small alphabet: many matches, runs included)."""

    def every_window(tokens: list[int], n_min: int, n_max: int, count: int) -> list[int]:
        length = len(tokens)
        if count < 1 or length < n_min + 1:
            return []
        for n in range(min(n_max, length - 1), n_min - 1, -1):
            starts = [i for i in range(length - n) if tokens[i : i + n] == tokens[length - n :]]
            if starts:
                full = [i for i in starts if i + n + count <= length]
                start = (full[-1] if full else starts[0]) + n
                return tokens[start : start + count]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 4, 50])) for _ in range(rng.randrange(0, 40))]
        n_min = rng.randint(1, 3)
        args = (tokens, n_min, rng.randint(n_min, 5), rng.randint(0, 6))
        assert lookup(*args) == every_window(*args), args


def test_ngram_proposer_answers_each_input_in_order():
    proposer = NgramProposer(1, 2)
    inputs = [DraftInput("a", [1, 2, 1], 2), DraftInput("b", [3, 4], 2), DraftInput("c", [7, 8, 7, 8, 7], 1)]
    assert proposer.propose(inputs) == [[2, 1], [], [8]]


@pytest.mark.parametrize(("fields", "message"), [
    ({"method": "mtp", "model": "/d"}, "speculative_config.model must be unset for method mtp"),
    ({"method": "eagle3"}, "speculative_config.model must name the draft's directory for method eagle3"),
    ({"method": "medusa"}, "speculative_config.method must be one of"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens must be a positive integer"),
    ({"prompt_lookup_max": True}, "speculative_config.prompt_lookup_max must be a positive integer"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min (5) must not exceed prompt_lookup_max"),
    ({"method": "draft_model"}, "speculative_config.model must name the draft's directory for method draft_model"),
    ({"draft_tensor_parallel_size": 1}, "speculative_config: unknown field 'draft_tensor_parallel_size'"),
])
def test_a_bad_speculative_config_names_its_field(fields, message):
    with pytest.raises(ValueError) as error:
        InferenceConfig(speculative=fields)
    assert message in str(error.value)


def test_the_config_crosses_a_process_boundary_as_plain_values():
    config = InferenceConfig(speculative=SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=4))
    assert InferenceConfig(**config.to_dict()).speculative == config.speculative


def test_the_flag_is_an_engine_option_carried_to_fleet_processes():
    import argparse  # noqa: PLC0415

    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415
    from megatron_serve.fleet.argv import inference_config_to_argv  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = inference_config_from_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2}']))
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=2)
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).to_dict() == config.to_dict()
    assert inference_config_from_args(parser.parse_args([])).speculative is None  # off unless asked


def test_make_proposer_builds_ngram():
    assert isinstance(make_proposer(InferenceConfig(speculative={"method": "ngram"})), NgramProposer)


# ------------------------------------------------------------------ the verifier draws from the target

VOCAB, TRIALS = 8, 4000
#: chi-square critical value, 7 degrees of freedom, p = 0.001 (a correct sampler fails 1 run in 1,000)
CRITICAL_7DF = 24.32


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def verify_once(seed: int, logits: torch.Tensor, draft: int, state: SamplingState, sampler: Sampler,
                speculator: Speculator) -> list[int]:
    request = EngineRequest(request_id=f"q{seed}", prompt_tokens=[1, 2, 3],
                            sampling_params=SamplingParams(temperature=1.0, seed=seed), arrival_time=0.0)
    sequence = Sequence.of(request, 100, frozenset())
    sequence.token_ids.append(draft)
    sequence.num_drafts, sequence.num_computed = 1, len(sequence.token_ids)
    state.add(request.request_id, request.sampling_params, seed, request.prompt_tokens, [], [])
    (out,) = speculator.verify([sequence], logits[1:2], logits[0:1], state, sampler)
    state.remove(request.request_id)
    assert len(out.tokens) == out.accepted + 1
    return out.tokens


def test_verification_draws_from_the_targets_distribution_and_accepts_with_its_probability():
    """Rejection sampling of a point-mass draft d: the first token is distributed as the target's p (accepted
    with probability p(d), else drawn from p without d); after an accepted draft the next comes from the next row."""
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 1.5
    p0, p1 = logits.softmax(-1).tolist()
    draft = int(torch.argsort(logits[0])[VOCAB // 2])  # a middling token: accepted sometimes, not always
    state, stats = SamplingState(VOCAB, torch.device("cpu")), EngineStats()
    sampler, speculator = Sampler(state), Speculator(NgramProposer(1, 1), 1, stats)
    first, second = [0] * VOCAB, [0] * VOCAB
    for seed in range(TRIALS):
        tokens = verify_once(seed, logits, draft, state, sampler, speculator)
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    assert chi_square(first, p0) < CRITICAL_7DF
    assert chi_square(second, p1) < CRITICAL_7DF
    accepted = stats.counters["spec_decode_num_accepted_tokens"]
    assert accepted == first[draft] == sum(second)
    assert abs(accepted / TRIALS - p0[draft]) < 4 * (p0[draft] * (1 - p0[draft]) / TRIALS) ** 0.5
    # The control: a verifier that took the draft half of the time (the draft's own distribution mixed in) fails.
    mixed = [0.5 * p + (0.5 if token == draft else 0.0) for token, p in enumerate(p0)]
    assert chi_square(first, mixed) > CRITICAL_7DF
    assert stats.counters["spec_decode_num_drafts"] == TRIALS
    assert stats.to_wire(0, 0)["spec_decode_num_accepted_tokens_per_pos"] == {"0": accepted}
