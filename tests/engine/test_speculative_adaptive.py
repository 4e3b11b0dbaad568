"""The adaptive K policy (engine.speculative.adaptive): K follows measured acceptance and measured step cost.

The policy is driven here with the numbers an engine would measure, so each rule is shown on its own: acceptance
that falls takes K to 0, acceptance that rises brings it back, and a batch whose extra rows cost as much as they
save gets a smaller K than a small batch at the same acceptance. The engine side (greedy output unchanged with
the policy on, K going to 0 where drafts are never accepted) runs the real engine on the tiny model.
"""

from __future__ import annotations

import math
import types
import random

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.speculative import adaptive, decoder
from megatron_serve.engine.speculative.adaptive import (CONFIDENT_TRIALS, PLAIN_COLD, PLAIN_NEEDED, PLAIN_REFRESH, PLAIN_SAMPLE, PROBE_BUDGET,
                                                         PROBE_MIN, RECHECK, RECHECK_MAX, AdaptiveK, PinnedK, bucket)
from megatron_serve.wire.engine_stats import EngineStats
from ..prompts import run_to_end

K = 4


def plain_steps(policy: AdaptiveK, batch: int, seconds: float) -> None:
    """As many steps without drafts as a batch size's model needs (the first ones measured are left out: cold)."""
    for _ in range(PLAIN_COLD + PLAIN_NEEDED):
        policy.step_cost(batch, 0, seconds)


def measured(policy: AdaptiveK, batch: int, plain: float, per_k: float) -> None:
    """Steps of ``batch`` decode rows costing ``plain + per_k * mean K`` seconds, at mean K 0 and 1 .. K."""
    plain_steps(policy, batch, plain)
    for mean_k in (1, 2, K, 0):
        policy.step_cost(batch, mean_k * batch, plain + per_k * mean_k)


def verify(policy: AdaptiveK, ids: list[str], rate: float, rng: random.Random, steps: int = 20) -> None:
    """``steps`` verify steps of K drafts per request, each draft accepted with probability ``rate`` in a row."""
    for _ in range(steps):
        for request_id in ids:
            accepted = 0
            while accepted < K and rng.random() < rate:
                accepted += 1
            policy.verified(request_id, K, accepted)


def test_falling_acceptance_takes_k_to_zero_and_rising_acceptance_brings_it_back():
    policy, rng, ids = AdaptiveK(K), random.Random(0), ["a", "b"]
    measured(policy, 2, plain=1.0, per_k=0.3)  # a draft per row costs 30% of a step: pays above ~30% acceptance
    verify(policy, ids, 0.9, rng)
    assert policy.choose(ids, [100, 100]) == [K, K]
    verify(policy, ids, 0.0, rng)
    assert policy.choose(ids, [100, 100]) == [0, 0]
    verify(policy, ids, 0.6, rng)
    middle = policy.choose(ids, [100, 100])
    assert all(0 < k < K for k in middle), middle  # a draft accepted 60% of the time pays for the first few only
    verify(policy, ids, 0.95, rng)
    assert policy.choose(ids, [100, 100]) == [K, K]
    assert policy.choose(ids, [2, 0]) == [2, 0]  # never past a request's length limit


def test_each_request_gets_the_k_of_its_own_acceptance():
    policy, rng = AdaptiveK(K), random.Random(1)
    measured(policy, 2, plain=1.0, per_k=0.3)
    verify(policy, ["copying"], 0.95, rng)
    verify(policy, ["inventing"], 0.05, rng)
    assert policy.choose(["copying", "inventing"], [100, 100]) == [K, 0]
    policy.forget("copying")  # a new request with its id starts from the engine-wide rate
    assert policy.requests.keys() == {"inventing"}


@pytest.mark.parametrize("weight", [adaptive.REQUEST_PRIOR_TRIALS, 2.0])
def test_one_guess_rejected_does_not_turn_a_well_accepted_request_off(monkeypatch, weight):
    """A declined request verifies nothing, so its estimate stays where its last verify left it: one early
    rejection must not take it below what drafting needs. Control: with the engine-wide rate weighing 2 trials
    in a request's estimate (as before), the same rejection declines it for good."""
    monkeypatch.setattr(adaptive, "REQUEST_PRIOR_TRIALS", weight)
    policy, rng = AdaptiveK(K), random.Random(6)
    plain_steps(policy, 1, 1.0)  # the costs of the benchmark's pair at batch 1 (CPU): a verify step costs half
    for mean_k in (1, 4, 2, 4, 3):  # a plain step more whatever its K, plus 0.4 of one per draft
        policy.step_cost(1, mean_k, 1.5 + 0.4 * mean_k)
    verify(policy, [f"other{i}" for i in range(8)], 0.92, rng)  # the engine-wide acceptance: about 92%
    assert policy.choose(["new"], [100]) == [K]
    policy.verified("new", K, 0)  # its first guess rejected (1 time in 12 at 92%)
    chosen = policy.choose(["new"], [100])[0]
    assert chosen >= 3 if weight > 2 else chosen == 0


def test_a_policy_that_drafts_every_step_measures_a_plain_step_again():
    """While every step drafts, no plain step is measured: the first one (here 2.0, a cold start) would stay the
    estimate that every verify step is weighed against. Every :data:`PLAIN_REFRESH` verify steps the policy takes
    plain steps until one is measured, and every sample ages both sides, so the new one counts."""
    policy, rng, ids = AdaptiveK(K), random.Random(7), ["a"]
    measured(policy, 1, plain=2.0, per_k=0.05)
    verify(policy, ids, 0.95, rng)
    for _ in range(PLAIN_REFRESH):
        assert policy.choose(ids, [100]) == [K]
        policy.step_cost(1, K, 1.2)
    assert policy.choose(ids, [100]) == [0]  # the step after a verify step is not measured (not overlapped):
    assert policy.choose(ids, [100]) == [0]  # the next one too, until a plain step was measured
    policy.step_cost(1, 0, 1.0)
    plain = policy.costs[1].fit()[0]  # type: ignore[index]
    assert 1.0 < plain < 1.6  # the old samples aged by the verify steps since (kept at full weight: 1.79)
    assert policy.choose(ids, [100]) == [K]


def test_a_batch_sizes_first_plain_steps_are_left_out_and_drafts_wait_for_enough_plain_steps():
    """A fresh engine's first decode steps run cold (1.5, 1.0, 0.84, 0.71 ms, then 0.6-0.7 at batch 1 on the CPU):
    weighed in, they made drafting look cheap. They are left out, and drafts are weighed only against several."""
    policy = AdaptiveK(K)
    for seconds in (2.5, 1.7, 1.4, 1.2)[:PLAIN_COLD]:
        assert policy.choose(["a"], [100]) == [0]
        policy.step_cost(1, 0, seconds)
    for _ in range(PLAIN_NEEDED):
        assert policy.choose(["a"], [100]) == [0]  # still measuring: no probe yet
        policy.step_cost(1, 0, 1.0)
    assert policy.costs[1].predict(0) == 1.0  # (with the cold steps weighed in: 1.4)
    assert policy.choose(["a"], [100]) == [1]  # measured: a probe


def test_a_batch_whose_rows_cost_what_they_save_gets_a_smaller_k():
    policy, rng = AdaptiveK(K), random.Random(2)
    small, large = [f"s{i}" for i in range(2)], [f"l{i}" for i in range(64)]
    measured(policy, 2, plain=1.0, per_k=0.05)  # batch 2: the step is bound by fixed costs, rows are nearly free
    measured(policy, 64, plain=4.0, per_k=4.0)  # batch 64: each draft per row costs what a step does
    verify(policy, small + large, 0.7, rng)
    k_small, k_large = policy.choose(small, [100] * 2), policy.choose(large, [100] * 64)
    assert k_small == [K] * 2
    assert max(k_large) < min(k_small)
    assert k_large == [0] * 64  # 70% acceptance does not pay a whole step per draft


def test_a_fixed_cost_of_drafting_at_all_is_told_from_the_cost_per_draft():
    """Steps with drafts cost 0.8 of a plain step more whatever their K, plus 0.1 per draft per row (a drafter
    forward and a sampler pass per step, cheap rows): the line through plain would call a draft 0.9 at K = 1."""
    policy, rng, ids = AdaptiveK(K), random.Random(4), ["a", "b"]
    plain_steps(policy, 2, 1.0)
    for mean_k in (1, 2, 4, 3, 1):
        policy.step_cost(2, 2 * mean_k, 1.8 + 0.1 * mean_k)
    plain, fixed, slope = policy.costs[2].fit()  # type: ignore[misc]
    assert (round(plain, 9), round(fixed, 9), round(slope, 9)) == (1.0, 0.8, 0.1)
    verify(policy, ids, 0.8, rng)
    assert policy.choose(ids, [100, 100]) == [K, K]  # worth it only with every draft: 1 + 4 * ... over 2.2
    verify(policy, ids, 0.3, rng)
    assert policy.choose(ids, [100, 100]) == [0, 0]  # 0.3 per draft never pays the fixed 0.8


def test_a_batch_size_without_a_model_borrows_the_nearest_one_until_it_has_its_own():
    policy, rng = AdaptiveK(K), random.Random(5)
    big, shrunk = [f"r{i}" for i in range(64)], [f"r{i}" for i in range(40)]
    measured(policy, 64, plain=4.0, per_k=8.0)  # batch 64: drafting never pays
    verify(policy, big, 0.7, rng)
    assert policy.choose(shrunk, [100] * 40) == [0] * 40  # requests finished: no probe at batch 40 straight away
    assert policy.costs[bucket(40)].fit() is None
    measured(policy, 2, plain=1.0, per_k=0.05)  # batch 2: drafting pays
    five = [f"r{i}" for i in range(5)]
    assert policy.choose(five, [100] * 5) == [K] * 5  # batch 5 (4-7) has no model: batch 2's (2-3) is nearest
    assert policy.costs[bucket(5)].fit() is None


def test_an_unmeasured_batch_size_measures_first_and_a_k_of_zero_is_probed_at_a_growing_interval():
    policy = AdaptiveK(K)
    for _ in range(PLAIN_COLD + PLAIN_NEEDED):  # nothing measured: steps without drafts first (the first run cold)
        assert policy.choose(["a"], [100]) == [0]
        policy.step_cost(1, 0, 1.0)
    assert policy.choose(["a"], [100]) == [1]  # then a probe: a step with a draft, then one with K drafts
    policy.step_cost(1, 1, 9.0)  # the first, where a draft model catches up, is not counted
    assert policy.choose(["a"], [100]) == [K]
    policy.step_cost(1, K, 1.06)  # the second: K drafts add 6% to a step
    plain, fixed, slope = policy.costs[1].fit()  # type: ignore[misc]
    assert (round(plain, 9), fixed, round(slope, 9)) == (1.0, 0.0, 0.015)  # the 9 s step left out
    assert policy.warmup == 8.0  # but remembered as what a probe's first step costs beyond a plain one
    policy.warmup = 0.0  # (say the proposer needs no catching up, as n-gram: probes are cheap)
    for _ in range(40):
        policy.verified("a", 1, 0)  # but is never accepted
    chosen = [policy.choose(["a"], [100])[0] for _ in range(PROBE_MIN * 3 + 2)]
    probes = [i for i, k in enumerate(chosen) if k]
    assert probes == [PROBE_MIN - 1, PROBE_MIN, 3 * PROBE_MIN, 3 * PROBE_MIN + 1]  # then twice the interval
    for _ in range(20):  # drafting got expensive (3x a plain step; each sample counts at most 1.5x the model's
        policy.step_cost(1, 1, 3.0)  # prediction, so it takes a few): probes are spaced to cost 1% of the time
        policy.step_cost(1, 0, 1.0)
    policy.warmup = 8.0  # and the probe's first step (a draft model catching up) cost 9x a plain one
    plain, fixed, slope = policy.costs[1].fit()  # type: ignore[misc]
    spacing = ((fixed + slope * K) / plain + 8.0) / PROBE_BUDGET  # both probe steps' extra cost within the budget
    # (the second at K drafts: counted at one draft, probes cost K times the budget's share of the slope)
    assert spacing > 1500
    chosen = [policy.choose(["a"], [100])[0] for _ in range(math.ceil(spacing) + 100)]
    probes = [i for i, k in enumerate(chosen) if k]
    assert probes == [math.ceil(spacing) - 1, math.ceil(spacing)]
    assert AdaptiveK(K).choose(["a"] * 32, [100] * 32) == [0] * 32  # (a batch of 32 measures without drafts,)
    policy = AdaptiveK(K)
    plain_steps(policy, 32, 1.0)
    assert policy.choose([str(i) for i in range(32)], [100] * 32) == [1, 1] + [0] * 30  # probes 1/16 of the rows
    assert PinnedK(K).choose(["a", "b"], [100, 2]) == [K, 2]  # adaptive: false drafts K whatever it costs


def test_a_decline_on_thin_evidence_is_probed_again_soon_and_on_enough_within_the_budget():
    """One probe's guesses are few: five, one rejected, read 0.72 for a pair whose acceptance is 0.9 (where drafting
    gains 9%), and the budget spaced the next probe 850 steps away. Until the engine-wide acceptance rests on
    CONFIDENT_TRIALS verified guesses, a decline is probed again every ``probe`` steps; after, within the budget."""
    def declined_after(verifies: list[tuple[int, int]]) -> list[int]:
        policy = AdaptiveK(K)
        measured(policy, 1, plain=1.0, per_k=0.7)  # drafting dear: a probe's K drafts cost 3.8x a plain step
        for drafts, accepted in verifies:
            policy.verified("a", drafts, accepted)
        chosen = [policy.choose(["a"], [100])[0] for _ in range(3 * PROBE_MIN)]
        return [i for i, k in enumerate(chosen) if k]

    thin = [(1, 1), (K, 1)]  # a probe: its first step's guess accepted, its second's second guess rejected
    assert AdaptiveK(K).overall.trials + 1 + 2 < CONFIDENT_TRIALS
    assert declined_after(thin)[:2] == [PROBE_MIN - 1, PROBE_MIN]  # probed again at once
    assert declined_after(thin * 4) == []  # the control: as many probes' worth of evidence, the budget spaces them


def run(engine: DynamicInferenceEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    requests = [DynamicInferenceRequest(f"r{i}", None, list(p), SamplingParams(
        temperature=0.0, ignore_eos=True, num_tokens_to_generate=tokens)) for i, p in enumerate(prompts)]
    run_to_end(engine, requests)
    return [r.generated_tokens for r in requests]


def test_offers_the_proposer_rarely_answers_are_not_made():
    """Prompt lookup answers an offer of K only where the request repeats itself (sampled text: 1 step in 30 on the
    benchmark's pair), and an offer costs a verify step either way. A request whose offers went unanswered gets
    K = 0 at an acceptance where one whose offers are answered drafts; the same acceptance without any offers
    recorded drafts for both (the control)."""
    def policy_with(answered: dict[str, int]) -> AdaptiveK:
        policy = AdaptiveK(K)
        for _ in range(PLAIN_COLD):  # (the first plain steps, left out: cold)
            policy.step_cost(1, 0, 1.0)
        for _ in range(5):  # a plain step 1.0; drafting at all costs 0.6 more, and 0.02 per draft
            policy.step_cost(1, 0, 1.0)
            policy.step_cost(1, 1, 1.62)
            policy.step_cost(1, K, 1.6 + 0.02 * K)
        for _ in range(20):
            for request_id in ("a", "b"):
                policy.verified(request_id, K, 3)  # accepted 3 of 4: a = 0.75
                if request_id in answered:
                    policy.proposed(request_id, answered[request_id])
        return policy

    control = policy_with({})
    assert control.choose(["a"], [100])[0] > 0 and control.choose(["b"], [100])[0] > 0
    policy = policy_with({"a": 0, "b": K})
    assert policy.choose(["a"], [100]) == [0]
    assert policy.choose(["b"], [100])[0] > 0


def test_a_declined_choice_stands_a_few_steps_longer_each_time_unless_news_comes():
    """The rule is weighed again after RECHECK steps for the same rows while it declines (13 us at 64 rows, 0.4%
    of a CPU step), twice as long each time it declines again, up to RECHECK_MAX; a verified draft or a proposal
    (news, from verify steps only) has it weighed at once, and other rows are weighed afresh."""
    policy, rng = AdaptiveK(K), random.Random(2)
    measured(policy, 1, plain=1.0, per_k=0.3)
    verify(policy, ["a"], 0.0, rng)
    assert policy.choose(["a"], [100]) == [0]
    for _ in range(60):  # drafting got cheap (plain steps dearer: a cost per draft of 3% of a step)
        policy.step_cost(1, 0, 10.0)
    policy.requests["a"] = type(policy.requests["a"])(9.0, 10.0)  # and its acceptance 0.9, unannounced
    chosen = [policy.choose(["a"], [100])[0] for _ in range(RECHECK + 1)]
    assert chosen[:RECHECK] == [0] * RECHECK and chosen[-1] > 0
    verify(policy, ["a"], 0.0, rng)  # news: acceptance fell
    policy.warmup = 1e6  # (no probe comes in between)
    stands = []
    for _ in range(5):
        assert policy.choose(["a"], [100]) == [0]
        stands.append(policy.quiet)
        for _ in range(policy.quiet):
            assert policy.choose(["a"], [100]) == [0]
    assert stands == [RECHECK, 2 * RECHECK, 4 * RECHECK, RECHECK_MAX, RECHECK_MAX]  # RECHECK_MAX = 8 * RECHECK
    assert policy.choose(["b"], [100]) == [0] and policy.quiet == RECHECK_MAX  # other rows: weighed afresh
    policy.verified("b", K, K)  # news
    assert policy.quiet == 0
    assert policy.choose(["b"], [100])[0] > 0 and policy.recheck == RECHECK  # drafts: the next decline stands RECHECK


class _Clock:
    """CPU time that the test moves forward; counts its reads."""

    def __init__(self) -> None:
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def _timed_steps(speculator: decoder.Speculator, clock: _Clock, seconds: list[float], rows: int = 4,
                 decode: bool = True) -> None:
    """Plain engine steps of ``seconds`` each, as ``DynamicInferenceEngine.step`` brackets them (``decode``: every
    row decodes, overlapped, so the step is one like the others)."""
    for cost in seconds:
        speculator.start_step(False)
        clock.now += cost
        if decode:
            speculator.time_step(rows, 0)
        speculator.end_step()


def _clocked_speculator(monkeypatch) -> tuple[decoder.Speculator, AdaptiveK, _Clock, list[tuple[int, int, float]]]:
    """A speculator on the test's clock, and the cost samples its policy is given (recorded, not learned)."""
    clock, samples = _Clock(), []
    monkeypatch.setattr(decoder.time, "process_time", clock)
    speculator = decoder.Speculator(object(), K, EngineStats())  # type: ignore[arg-type]
    policy = speculator.policy
    assert isinstance(policy, AdaptiveK)
    monkeypatch.setattr(policy, "step_cost", lambda rows, drafts, seconds: samples.append((rows, drafts, seconds)))
    return speculator, policy, clock, samples


def test_while_k_stays_zero_plain_steps_are_timed_in_runs_and_a_run_broken_by_another_step_is_dropped(monkeypatch):
    """In the engine a clock read cost 1.5 us and a cost update 3.3: timing each plain step made a declined
    speculator 2% slower than none. While K stays 0, a run of PLAIN_SAMPLE plain steps is one sample, their mean,
    from two reads; a run that meets a step of another kind (a prompt's chunk, drafts, another batch size) gives
    nothing. While a batch size is measured (nothing declined yet), each step is timed alone."""
    speculator, policy, clock, samples = _clocked_speculator(monkeypatch)
    _timed_steps(speculator, clock, [1.0, 2.0])  # measuring: each alone, two reads a step
    assert samples == [(4, 0, 1.0), (4, 0, 2.0)] and clock.reads == 4
    policy.idle, samples[:], clock.reads = 1, [], 0  # declined: runs
    _timed_steps(speculator, clock, [1.0] * 3)
    _timed_steps(speculator, clock, [5.0], decode=False)  # a prompt's chunk: the run so far is dropped
    _timed_steps(speculator, clock, [1.0] * 3 + [9.0], rows=4)
    _timed_steps(speculator, clock, [1.0], rows=5)  # another batch size: dropped again
    assert samples == []
    _timed_steps(speculator, clock, [1.0 + 0.5 * (i % 2) for i in range(PLAIN_SAMPLE)])
    assert samples == [(4, 0, 1.25)]  # the run's mean
    assert clock.reads == 4  # one at each of the three runs' first step, one at the end of the complete run


def test_greedy_output_is_the_plain_engines_with_the_adaptive_policy_on(tiny_llama):
    """A phrase repeated in the prompt (prompt lookup's food): some steps draft, and the tokens stay the target's."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(4)] * 6 for _ in range(4)]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3)
    assert spec.adaptive  # the default
    adaptive = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16, speculative=spec))
    plain = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16))
    assert run(adaptive, prompts, 40) == run(plain, prompts, 40)
    counters = adaptive.stats.counters
    assert counters["spec_decode_num_rows"] > 0
    assert counters["spec_decode_num_draft_tokens"] < K * counters["spec_decode_num_rows"]  # K was not pinned
    assert counters["spec_decode_num_draft_tokens"] > 0  # and it drafted (the measuring steps at least)
    assert not adaptive.speculator.policy.requests  # finished requests leave no estimate behind


def test_steps_the_policy_rests_through_choose_what_it_would_have_chosen(monkeypatch):
    """While a decline stands (no rule run, no probe due), the engine skips the K policy (its calls cost 7 us a
    step at batch 1 between torch's kernels, 1.1% of a CPU step) and reports the steps afterwards: the choices
    are those of a policy asked every step, probes at the same steps, and most steps were skipped."""
    def simulate(rest: bool) -> tuple[list[dict[str, int]], int]:
        speculator = decoder.Speculator(object(), K, EngineStats())  # type: ignore[arg-type]
        policy = speculator.policy
        assert isinstance(policy, AdaptiveK)
        measured(policy, 1, plain=1.0, per_k=0.7)  # drafting dear: declined, probed now and then
        monkeypatch.setattr(policy, "step_cost", lambda *args: None)  # (the skipped steps' time is not compared)
        row = types.SimpleNamespace(request_id="a", token_ids=[1] * 10, pending_tokens=0, finished=False,
                                    num_computed=9, max_total_tokens=100_000)
        chosen, skipped = [], 0
        for _ in range(3000):
            if rest and speculator.resting(1):
                chosen.append({})
                skipped += 1
                continue
            ks = speculator.plan([row])  # type: ignore[list-item]
            chosen.append(ks)
            if ks:
                policy.proposed("a", ks["a"])
                policy.verified("a", ks["a"], 0)  # every guess rejected
        return chosen, skipped

    (asked, _), (rested, skipped) = simulate(False), simulate(True)
    assert rested == asked
    assert sum(bool(ks) for ks in asked) >= 4  # probes came, at the same steps
    assert skipped > 0.8 * len(asked)


def test_a_rest_times_its_steps_as_one_sample_and_a_run_open_before_it_starts_again(monkeypatch):
    """The steps the engine skips the policy for are timed together (one sample, their mean); a run of timed
    plain steps open when the rest began starts again after it (spanning the rest, it would count the skipped
    steps' time as its own: 1 + 8/8 = 2.0 s a step here, where each took 1.0)."""
    speculator, policy, clock, samples = _clocked_speculator(monkeypatch)
    monkeypatch.setattr(policy, "choose", lambda ids, caps: [0] * len(ids))  # declined,
    monkeypatch.setattr(policy, "restful_steps", lambda: 4)  # and it stands 4 more steps
    policy.idle = 1
    rows = [types.SimpleNamespace(request_id=f"r{i}", token_ids=[1] * 10, pending_tokens=0, finished=False,
                                  num_computed=9, max_total_tokens=100) for i in range(4)]
    _timed_steps(speculator, clock, [1.0] * 3)  # a run of plain steps, 3 of 8 timed
    assert speculator.plan(rows) == {}  # type: ignore[arg-type]
    for _ in range(4):
        assert speculator.resting(4)
        clock.now += 2.0
    assert not speculator.resting(4)
    speculator.plan(rows)  # type: ignore[arg-type]
    assert samples == [(4, 0, 2.0)]  # the rest, one sample
    _timed_steps(speculator, clock, [1.0] * PLAIN_SAMPLE)
    assert samples[1:] == [(4, 0, 1.0)]
