"""``--logprobs-mode processed_logprobs`` through a fleet (coordinator + engine processes): the engines start in
the mode asked for, a request at temperature T reports the trainer's ``log_softmax(logits / T)`` bitwise, and
the run-time parity check scores processed with processed, so any temperature, top-k, top-p or min-p counts 0
mismatches. The controls: a fleet in the raw mode (where fleet engines started before) reports other values,
and the check scoring raw log probs against processed ones counts every sampled request as a mismatch.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.engine.sampling.logprob_parity import ParityChecker
from megatron_serve.invariant import batch_invariant

from ..devices import tensor_parallel_device
from .runs import load_trainer_model, run_all, target_prompt

TOKENS = 12
SETTINGS = [dict(temperature=0.7), dict(temperature=1.3, top_k=20), dict(temperature=0.9, top_p=0.8),
            dict(temperature=0.7, min_p=0.05), dict(temperature=0.6, top_k=40, top_p=0.95), dict(temperature=0.0)]


def _params(seed: int, **processing) -> SamplingParams:
    return SamplingParams(seed=seed, num_tokens_to_generate=TOKENS, ignore_eos=True, return_log_probs=True,
                          **processing)


def _config(mode: str) -> InferenceConfig:
    return InferenceConfig(dtype="float32", device=tensor_parallel_device(1), batch_invariant=True, block_size_tokens=16,
                           logprobs_mode=mode, verify_logprobs_fraction=1.0)


def _fleet(model_dir: str, mode: str) -> tuple[list, dict[str, int]]:
    """Every setting's request through a one-engine fleet, and the engine's parity counters once it checked
    them all."""
    llm = MegatronLLM(model_dir, _config(mode), use_coordinator=True, num_engines=1)
    try:
        prompts = [target_prompt(seed) for seed in range(len(SETTINGS))]
        results = llm.generate(prompts, [_params(seed, **s) for seed, s in enumerate(SETTINGS)])
        deadline = time.monotonic() + 120
        while True:  # the engine's metrics come with its heartbeats (none before its first)
            metrics = llm.status()["engines"][0]["metrics"]
            counters = metrics["counters"] if metrics else {"logprob_parity_checked": 0}
            if counters["logprob_parity_checked"] >= len(SETTINGS):
                return results, counters
            assert time.monotonic() < deadline, f"the engine checked {counters['logprob_parity_checked']} requests"
            time.sleep(0.05)
    finally:
        llm.shutdown()


def _trainer_processed(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The trainer's temperature-scaled log probs: ``log_softmax(logits.float() / T)``, a division as the sampler's."""
    with torch.no_grad(), batch_invariant():
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits.float()[0]
    log_probs = torch.log_softmax(logits / temperature, -1)
    return [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_a_fleet_reports_processed_log_probs_and_checks_them_like_with_like(models, mode):
    results, counters = _fleet(models["llama"], mode)
    model = load_trainer_model(models["llama"], "float32").eval()
    assert counters["logprob_parity_mismatch"] == 0
    result = results[0]  # temperature 0.7, no filter: the trainer's log_softmax(logits / T)
    trainer = _trainer_processed(model, target_prompt(0), result.generated_tokens, 0.7)
    if mode == "processed_logprobs":
        assert result.generated_log_probs == trainer
    else:  # the control: raw log probs (what every fleet engine reported before)
        assert all(a != b for a, b in zip(result.generated_log_probs, trainer))


def test_control_the_check_scoring_raw_log_probs_counts_processed_ones_as_mismatches(models, monkeypatch):
    monkeypatch.setattr(ParityChecker, "score_view", property(lambda self: None))
    engine = DynamicInferenceEngine.from_model_dir(models["llama"], _config("processed_logprobs"))
    try:
        run_all(engine, [DynamicInferenceRequest(f"r{seed}", None, target_prompt(seed), _params(seed, **s))
                         for seed, s in enumerate(SETTINGS)])
        while engine.parity.pending:
            engine.step()
        counters = engine.stats.counters
    finally:
        engine.shutdown()
    assert counters["logprob_parity_checked"] == len(SETTINGS)
    assert counters["logprob_parity_mismatch"] == len(SETTINGS) - 1  # all but the greedy one


def test_requests_whose_processing_reads_their_history_are_not_checked_in_the_processed_mode():
    """Penalties, logit bias, min_tokens and grammars read the tokens generated so far: a prompt's rows do not
    carry them, so scoring cannot give what was reported. The raw mode checks them (their raw log probs)."""
    processed = ParityChecker(1.0, 1024, "processed_logprobs")
    raw = ParityChecker(1.0, 1024, "raw_logprobs")
    for controls in (dict(repetition_penalty=1.2), dict(logit_bias={5: 1.0}), dict(min_tokens=3),
                     dict(frequency_penalty=0.5)):
        params = _params(0, temperature=0.7, **controls)
        assert not processed.comparable(params) and raw.comparable(params)
    assert processed.comparable(_params(0, temperature=0.7, top_k=20, top_p=0.9))
    assert not ParityChecker(1.0, 1024, "raw_logits").comparable(_params(0))
