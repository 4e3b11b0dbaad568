"""Steps without drafts run as plain, overlapped steps with speculation on; verify steps come between them.

When the K policy gives no request a draft, the engine runs the step it runs without speculation (launched before
the step in flight is read, the drafter not called), so a declined speculation costs nothing. A verify step first
reads the step in flight. The K policy here is a script (the adaptive one decides from measured CPU time, which
no test can pin down), so that transitions both ways happen at known steps; the tokens must not notice.
"""

from __future__ import annotations

import random

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.wire.sampling_params import StructuredOutputsParams

from .test_speculative import looping, outputs, repetitive_prompts, run
from .test_speculative_grammar import OBJECTS

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


class ScriptedK:
    """A K policy that gives every row ``script[step % len(script)]`` drafts (the adaptive policy's interface)."""

    def __init__(self, script: list[int]):
        self.script, self.steps = script, 0

    def choose(self, request_ids: list[str], caps: list[int]) -> list[int]:
        k = self.script[self.steps % len(self.script)]
        self.steps += 1
        return [min(k, cap) for cap in caps]

    def proposed(self, request_id: str, drafts: int) -> None:
        pass

    def unanswered(self) -> None:
        pass

    def verified(self, request_id: str, drafts: int, accepted: int) -> None:
        pass

    def times_step(self, drafting: bool) -> int:
        return 0

    def restful_steps(self) -> int:
        return 0  # the script decides every step

    def rested(self, steps: int) -> None:
        pass

    def step_cost(self, batch_size: int, draft_tokens: int, seconds: float) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def engine(model: str, script: list[int] | None, **kwargs) -> DynamicInferenceEngine:
    config = InferenceConfig(block_size_tokens=16, speculative=None if script is None else SPEC, **kwargs)
    built = DynamicInferenceEngine.from_model_dir(model, config)
    if script is not None:
        built.speculator.policy = ScriptedK(script)
    return built


def mixed_params(seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [looping(rng, num_tokens_to_generate=40, return_log_probs=True, top_n_logprobs=2),
            looping(rng, temperature=0.9, seed=4, num_tokens_to_generate=36, frequency_penalty=0.3,
                    return_log_probs=True),
            SamplingParams(temperature=1.0, seed=9, num_tokens_to_generate=80, return_log_probs=True,
                           structured_outputs=StructuredOutputsParams(json=OBJECTS)),
            looping(rng, num_tokens_to_generate=30, stop_token_ids=[])]


def run_watching(engine_: DynamicInferenceEngine, prompts: list[list[int]], params: list[SamplingParams]
                 ) -> tuple[list[DynamicInferenceRequest], list[bool]]:
    """``run``, and after each step whether it left a step in flight (launched, not read: overlapped)."""
    requests = [DynamicInferenceRequest(f"r{i}", None, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for request in requests:
        engine_.add_request(request)
    in_flight = []
    while engine_.has_unfinished_requests():
        engine_.step()
        in_flight.append(engine_._in_flight is not None)  # noqa: SLF001 - what the test is about
    return requests, in_flight


def test_plain_and_verify_steps_interleaved_emit_the_plain_engines_tokens(tiny_llama):
    """Overlapped steps without drafts, verify steps of K 2 and 4, and the switches between them, over greedy,
    seeded sampled with a penalty, and grammar requests: the output of an engine without speculation."""
    prompts = repetitive_prompts(41, 4)
    params = mixed_params(41)
    reference = outputs(run(engine(tiny_llama, None, batch_invariant=True), prompts, params))
    spec = engine(tiny_llama, [0, 0, 2, 0, 4, 4, 0, 0, 0, 3], batch_invariant=True)
    requests, in_flight = run_watching(spec, prompts, params)
    assert outputs(requests) == reference
    assert spec.stats.counters["spec_decode_num_accepted_tokens"] > 0
    assert sum(in_flight) > len(in_flight) // 3  # the steps without drafts overlapped


def test_a_declined_speculation_runs_overlapped_and_never_calls_the_drafter(tiny_llama):
    spec = engine(tiny_llama, [0])
    proposer = spec.speculator.proposer
    calls = []
    real = proposer.propose
    proposer.propose = lambda inputs: calls.append(inputs) or real(inputs)
    prompts = repetitive_prompts(43, 3)
    params = mixed_params(43)[:3]
    requests, in_flight = run_watching(spec, prompts, params)
    plain = run(engine(tiny_llama, None), prompts, params)
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in plain]
    assert calls == []
    assert in_flight.count(True) >= len(in_flight) - 2  # every step but the last left the next one running
    assert spec.stats.counters["spec_decode_num_rows"] > 0  # the rows could have drafted
    assert spec.stats.counters["spec_decode_num_draft_tokens"] == 0


def test_control_without_async_scheduling_nothing_is_left_in_flight(tiny_llama):
    """The counterpart of the test above: the same run with overlapping off leaves no step in flight."""
    spec = engine(tiny_llama, [0], async_scheduling=False)
    _, in_flight = run_watching(spec, repetitive_prompts(43, 3), mixed_params(43)[:3])
    assert not any(in_flight)
