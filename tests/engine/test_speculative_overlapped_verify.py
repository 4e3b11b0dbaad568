"""Verify steps launched before the step in flight is read: the output stays the plain engine's.

A verify step is planned as if the step in flight (plain or verify) accepted every draft, its drafts proposed past
the token in flight; on the device its rows move back by the drafts that step rejected. Each test drives the
transitions with a scripted K policy (consecutive verify steps, plain steps between them), compares tokens, log
probs and top log probs with an engine without speculation (``==``, batch-invariant), and checks that verify steps
really were launched while another step was in flight (``Speculator.overlapped_verify_steps``). The control
disables the correction (every shift 0) and the tokens change.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from msgspec.structs import replace

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine import DynamicInferenceEngine, scheduler
from megatron_serve.engine.speculative.decoder import Speculator
from megatron_serve.wire.request import FinishReason
from megatron_serve.wire.sampling_params import StructuredOutputsParams

from .test_speculative import looping, outputs, repetitive_prompts, run
from .test_speculative_grammar import OBJECTS
from .test_speculative_overlap import ScriptedK

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
SCRIPTS = [[4], [3, 3, 0, 2, 4, 0, 0, 1]]  # verify steps back to back; and transitions both ways


def speculative(method: str, model: str) -> SpeculativeConfig:
    """n-gram, or the target as its own draft model: it guesses the unbiased rows' greedy tokens (accepted), and
    not the tokens of rows whose logit bias or sampling it does not see (rejected: shifts > 0)."""
    if method == "ngram":
        return NGRAM
    return SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=3)


def engine(model: str, spec: SpeculativeConfig | None, script: list[int] | None = None,
           **kwargs) -> DynamicInferenceEngine:
    config = InferenceConfig(speculative=spec, **{"block_size_tokens": 16, "batch_invariant": True, **kwargs})
    built = DynamicInferenceEngine.from_model_dir(model, config)
    if script is not None:
        built.speculator.policy = ScriptedK(script)
    return built


def mixed_jobs(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and parameters: greedy with top log probs, biased and not; seeded sampled with penalties, top-k,
    biased and not; and n = 2 seeded samples of one prompt."""
    rng = random.Random(seed)
    prompts = repetitive_prompts(seed, 5)
    sampled = looping(rng, temperature=0.8, top_k=30, seed=3, n=2, num_tokens_to_generate=30, return_log_probs=True,
                      top_n_logprobs=1)
    params = [looping(rng, num_tokens_to_generate=36, return_log_probs=True, top_n_logprobs=2),
              looping(rng, temperature=0.9, seed=4, num_tokens_to_generate=34, frequency_penalty=0.3,
                      presence_penalty=0.2, repetition_penalty=1.1, return_log_probs=True),
              SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=32, return_log_probs=True,
                             top_n_logprobs=2),
              SamplingParams(temperature=0.5, seed=8, ignore_eos=True, num_tokens_to_generate=32, presence_penalty=0.3,
                             return_log_probs=True),
              *sampled.choices()]
    return [*prompts[:4], prompts[4], prompts[4]], params


@pytest.fixture(scope="module")
def plain_mixed(tiny_llama) -> list[tuple]:
    """The plain engine's outputs of ``mixed_jobs(51)``: the same for every run compared with them, so run once."""
    return outputs(run(engine(tiny_llama, None), *mixed_jobs(51)))


def check_against_plain(tiny_llama: str, spec_engine: DynamicInferenceEngine, prompts: list[list[int]],
                        params: list[SamplingParams],
                        plain: list[tuple] | None = None) -> list[DynamicInferenceRequest]:
    """``spec_engine``'s run of the jobs, checked against the plain engine's (``plain``: its outputs, known)."""
    got = run(spec_engine, prompts, params)
    assert outputs(got) == (plain if plain is not None else outputs(run(engine(tiny_llama, None), prompts, params)))
    counters, speculator = spec_engine.stats.counters, spec_engine.speculator
    assert counters["spec_decode_num_accepted_tokens"] > 0
    assert counters["spec_decode_num_draft_tokens"] > counters["spec_decode_num_accepted_tokens"]  # rejections too
    assert speculator.overlapped_verify_steps > 0
    assert spec_engine.load().kv_blocks_free == spec_engine.load().kv_blocks_total  # rolled-back blocks came back
    return got


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("script", SCRIPTS, ids=["back_to_back", "transitions"])
def test_overlapped_verify_steps_emit_the_plain_engines_tokens(tiny_llama, plain_mixed, method, script):
    spec = engine(tiny_llama, speculative(method, tiny_llama), script)
    check_against_plain(tiny_llama, spec, *mixed_jobs(51), plain=plain_mixed)


def test_stop_tokens_and_length_limits_end_requests_mid_draft_with_a_verify_step_in_flight(tiny_llama):
    """A request that stops (stop token, EOS, length) among the tokens of a verify step in flight has its rows of the
    step launched after it dropped; the others go on. ``min_tokens`` holds a stop token back by the count of tokens
    generated, which the device corrects with the positions."""
    prompts = repetitive_prompts(5, 4)
    rng = random.Random(5)
    loops = [looping(rng, num_tokens_to_generate=40, return_log_probs=True) for _ in prompts]
    free = run(engine(tiny_llama, None), prompts, loops)
    params = [replace(loop, stop_token_ids=[request.generated_tokens[11]]) for request, loop in zip(free, loops)]
    params.append(replace(loops[0], ignore_eos=False, termination_id=free[0].generated_tokens[7]))  # as its EOS
    params += [replace(loop, stop_token_ids=[request.generated_tokens[1]], min_tokens=n)
               for n, request, loop in zip([9, 14], free, loops)]
    params += [replace(loop, num_tokens_to_generate=n) for n, loop in zip([3, 8, 13, 21], loops)]
    jobs = prompts + prompts[:1] + prompts[:2] + prompts
    got = check_against_plain(tiny_llama, engine(tiny_llama, NGRAM, [4, 4, 2]), jobs, params)
    assert [r.finish_reason for r in got[:7]] == [FinishReason.STOP] * 7
    assert [len(r.generated_tokens) >= n for r, n in zip(got[5:7], [9, 14])] == [True, True]
    assert [len(r.generated_tokens) for r in got[7:]] == [3, 8, 13, 21]


def test_an_abort_while_a_verify_step_is_in_flight(tiny_llama):
    """Requests aborted while the verify step that drafted for them is in flight leave nothing behind; the others
    emit the plain engine's tokens."""
    prompts = repetitive_prompts(61, 4)
    rng = random.Random(61)
    params = [looping(rng, num_tokens_to_generate=30, return_log_probs=True) for _ in prompts]
    reference = run(engine(tiny_llama, None), prompts, params)
    spec = engine(tiny_llama, NGRAM, [4])
    requests = [DynamicInferenceRequest(f"r{i}", None, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for request in requests:
        spec.add_request(request)
    aborted: list[str] = []
    while spec.has_unfinished_requests():
        spec.step()
        in_flight = spec._in_flight  # noqa: SLF001 - what the test is about
        if len(aborted) < 2 and in_flight is not None and in_flight.verification is not None:
            victim = next(s for s, k in zip(in_flight.sampling, in_flight.drafts) if k and not s.finished)
            aborted.append(victim.request_id)
            spec.abort_request(victim.request_id)
    assert len(aborted) == 2 and spec.speculator.overlapped_verify_steps > 0
    for request, expected in zip(requests, reference):
        if request.request_id in aborted:
            assert request.finish_reason == FinishReason.ABORT
            assert request.generated_tokens == expected.generated_tokens[: len(request.generated_tokens)]
        else:
            assert outputs([request]) == outputs([expected])
    assert spec.load().kv_blocks_free == spec.load().kv_blocks_total


def test_preemption_under_a_tiny_pool_with_verify_steps_in_flight(tiny_llama, monkeypatch):
    """Drafts and the optimistic plan of a verify step in flight need KV blocks: a pool of 16 blocks of 4 tokens
    preempts; a preempted request whose verify step is in flight (the plain step after it was being scheduled)
    gets that step's tokens and is recomputed."""
    rollback, preempted_in_flight = scheduler.roll_back, []

    def spy(sequence, drafts, *args):
        if drafts and not sequence.block_table:  # its drafts' step was read after the request lost its blocks
            preempted_in_flight.append(sequence.request_id)
        return rollback(sequence, drafts, *args)

    monkeypatch.setattr(scheduler, "roll_back", spy)
    kwargs = dict(block_size_tokens=4, num_kv_blocks=16, max_batch_tokens=32, long_prefill_token_threshold=0)
    prompts = repetitive_prompts(21, 5)
    prompts[1] = prompts[0][:8] + prompts[1]  # a shared prefix: prefix-cache hits
    rng = random.Random(21)
    params = [looping(rng, num_tokens_to_generate=24, return_log_probs=True) for _ in prompts]
    params[2] = replace(params[2], temperature=0.7, seed=2, frequency_penalty=0.2)
    spec = engine(tiny_llama, NGRAM, [4, 0, 3, 0], **kwargs)  # each verify step in flight while a plain one plans
    got = run(spec, prompts, params)
    assert outputs(got) == outputs(run(engine(tiny_llama, None, **kwargs), prompts, params))
    assert spec.stats.counters["num_preemptions"] > 0
    assert spec.speculator.overlapped_verify_steps > 0
    assert preempted_in_flight
    assert spec.load().kv_blocks_free == spec.load().kv_blocks_total


def test_fallbacks_verify_with_the_step_before_read(tiny_llama):
    """A running request with a grammar, or no overlapped scheduling, makes every verify step read the step in
    flight first: none is launched while another is in flight, and the output is still the plain engine's."""
    prompts = repetitive_prompts(71, 2)
    rng = random.Random(71)
    params = [looping(rng, num_tokens_to_generate=24, return_log_probs=True),
              SamplingParams(temperature=1.0, seed=9, num_tokens_to_generate=40, return_log_probs=True,
                             structured_outputs=StructuredOutputsParams(json=OBJECTS))]
    reference = outputs(run(engine(tiny_llama, None), prompts, params))
    for spec, jobs in ((engine(tiny_llama, NGRAM, [4]), params),
                       (engine(tiny_llama, NGRAM, [4], async_scheduling=False), params[:1])):
        assert outputs(run(spec, prompts[: len(jobs)], jobs)) == reference[: len(jobs)]
        assert spec.stats.counters["spec_decode_num_drafts"] > 0
        assert spec.speculator.overlapped_verify_steps == 0


def test_control_without_the_device_correction_the_tokens_change(tiny_llama, plain_mixed, monkeypatch):
    """The control: with every shift forced to 0 (the next step planned as if every draft were accepted, left
    uncorrected) the same run emits other tokens, so the tests above see the correction at work."""
    launch = Speculator.launch_verify

    def uncorrected(self, *args, **kwargs):
        verification = launch(self, *args, **kwargs)
        return dataclasses.replace(verification, shifts=verification.shifts * 0)

    monkeypatch.setattr(Speculator, "launch_verify", uncorrected)
    jobs, params = mixed_jobs(51)
    spec = engine(tiny_llama, NGRAM, SCRIPTS[1])
    assert outputs(run(spec, jobs, params)) != plain_mixed
    assert spec.speculator.overlapped_verify_steps > 0


def test_a_request_whose_drafts_are_in_flight_reads_them_before_drafting_again(tiny_llama):
    """Drafting past a verify step in flight would take every one of its drafts as kept and guess the token after
    them, and each later step's drafts would build on that assumption: once one failed, hardly any was accepted
    (the benchmark's draft model at K = 4: 1.04 tokens a step, 4.1 when reading first). A request whose drafts are
    in flight reads them first: back to back, it accepts what a run that reads every verify step first accepts
    (the control, drafting past them: 9 of 508 drafts accepted where reading first accepts 103 of 194), and past a
    plain step's token (a guess of that token only) the verify step is still overlapped. The target drafts for
    itself without the requests' small logit bias, so that some guesses are rejected."""
    prompts = repetitive_prompts(5, 4)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=40,
                             logit_bias={t: 0.1 for t in range(20 + 7 * i, 40 + 7 * i)}) for i in range(4)]
    counts = []
    for kwargs in ({}, {"async_scheduling": False}):
        spec = engine(tiny_llama, speculative("draft_model", tiny_llama), [4], **kwargs)
        run(spec, prompts, params)
        counts.append((spec.stats.counters["spec_decode_num_accepted_tokens"],
                       spec.stats.counters["spec_decode_num_draft_tokens"]))
    (accepted, drafted), (accepted_serial, drafted_serial) = counts
    assert 0 < accepted_serial < drafted_serial  # guesses accepted and rejected
    assert accepted >= 0.9 * accepted_serial and drafted <= 1.1 * drafted_serial
    alternating = engine(tiny_llama, NGRAM, [4, 0])
    run(alternating, prompts, params)
    assert alternating.speculator.overlapped_verify_steps > 0


def test_a_step_hands_out_one_output_per_request(tiny_llama):
    """A verify step that reads the step in flight first (a request drafting again while its guesses are in flight)
    has that request's tokens of both steps: they come as one output, as an engine process sends a step (one delta
    per request; a second one for the same request arrived after its result, and a fleet's request ended 5 tokens
    short)."""
    prompts = repetitive_prompts(9, 4)
    rng = random.Random(9)
    params = [looping(rng, num_tokens_to_generate=30) for _ in prompts]
    spec = engine(tiny_llama, NGRAM, [4])
    requests = [DynamicInferenceRequest(f"r{i}", None, list(p), q) for i, (p, q) in enumerate(zip(prompts, params))]
    for request in requests:
        spec.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while spec.has_unfinished_requests():
        outputs = spec.step()
        ids = [out.request.request_id for out in outputs]
        assert len(ids) == len(set(ids))
        for out in outputs:
            tokens[out.request.request_id] += out.new_tokens
    assert spec.speculator.overlapped_verify_steps > 0 and spec.stats.counters["spec_decode_num_accepted_tokens"] > 0
    assert [tokens[r.request_id] for r in requests] == [r.generated_tokens for r in requests]
