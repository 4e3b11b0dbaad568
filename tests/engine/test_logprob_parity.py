"""``--verify-logprobs-fraction``: finished requests scored again as one prompt, compared bitwise, counted.

A real engine on the tiny model. The check's verdicts are shown three ways: a deliberately injected
mismatch is counted and logged by name and position beside an untouched request that checks clean
(bfloat16 in the batch-invariant mode, where decode and prefill agree by design); the same requests in
float32 without the batch-invariant mode differ in the last bits (decode and prefill reduce in another
order), and the check sees it; which requests are checked is a function of their ids alone.
"""

from __future__ import annotations

import argparse
import logging
import math

import msgspec
import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.engine.sampling import logprob_parity
from megatron_serve.engine.sampling.logprob_parity import SCORING_PREFIX, chosen

from ..prompts import PROMPTS

pytestmark = pytest.mark.timeout(300)


def sampled(seed: int, tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, num_tokens_to_generate=tokens, ignore_eos=True,
                          return_log_probs=True)


def engine_for(model: str, dtype: str, fraction: float = 1.0, batch_invariant: bool = False
               ) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_model_dir(model, InferenceConfig(
        dtype=dtype, verify_logprobs_fraction=fraction, num_kv_blocks=128, block_size_tokens=16,
        batch_invariant=batch_invariant))


def add(engine: DynamicInferenceEngine, request_id: str, prompt: str, params: SamplingParams) -> DynamicInferenceRequest:
    request = DynamicInferenceRequest(request_id, prompt, engine.tokenizer.encode(prompt), params)
    engine.add_request(request)
    return request


def run_out(engine: DynamicInferenceEngine, delivered: list[str]) -> None:
    while engine.has_unfinished_requests():
        delivered += [out.request.request_id for out in engine.step()]


def test_an_injected_mismatch_is_counted_and_logged_with_request_and_position(tiny_llama, caplog):
    engine = engine_for(tiny_llama, "bfloat16", batch_invariant=True)
    clean = add(engine, "clean", PROMPTS[1], sampled(1))
    bad = add(engine, "tampered", PROMPTS[2], sampled(2))
    delivered: list[str] = []
    while "tampered" not in delivered:  # its output is out; its check is queued and has not run
        delivered += [out.request.request_id for out in engine.step() if out.finished]
    check = engine.parity.pending[SCORING_PREFIX + "tampered"]
    assert check.reported == bad.generated_log_probs
    check.reported[4] = math.nextafter(check.reported[4], 0.0)  # one ulp: the check is bitwise
    with caplog.at_level(logging.WARNING, logger="megatron_serve.engine.sampling.logprob_parity"):
        run_out(engine, delivered)
    assert sorted(delivered) == ["clean", "tampered"]  # the scoring requests never reach the caller
    assert clean.generated_log_probs and not engine.parity.pending
    counters = engine.stats.counters
    assert (counters["logprob_parity_checked"], counters["logprob_parity_mismatch"]) == (2, 1)
    [record] = [r for r in caplog.records if "parity mismatch" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "request tampered, generated token 4 " in record.getMessage() and "1 of 12 tokens differ" in record.getMessage()
    prompt_len = len(engine.tokenizer.encode(PROMPTS[2]))
    assert f"(position {prompt_len + 4} of prompt + completion)" in record.getMessage()
    assert counters["generation_tokens"] == 24 and counters["prompt_tokens"] == len(clean.prompt_tokens) + prompt_len


@pytest.mark.parametrize("scored_raw", [False, True])
def test_a_kept_ids_request_is_checked_against_its_renormalized_log_probs(tiny_llama, monkeypatch, scored_raw):
    """``return_top_p_token_ids`` with top-p reports log probs renormalized over the kept ids in the raw mode too: its
    check scores them through the same filters and counts no mismatch; the control scores them raw (as a request
    that did not ask) and counts one."""
    if scored_raw:
        monkeypatch.setattr(logprob_parity, "renormalized", lambda params: False)
    engine = engine_for(tiny_llama, "bfloat16", batch_invariant=True)
    params = msgspec.structs.replace(sampled(3), top_p=0.7, return_top_p_token_ids=True)
    request = add(engine, "kept", PROMPTS[1], params)
    run_out(engine, [])
    assert len(request.generated_top_p_token_ids) == 12
    counters = engine.stats.counters
    assert (counters["logprob_parity_checked"], counters["logprob_parity_mismatch"]) == (1, int(scored_raw))


def test_float32_without_the_batch_invariant_mode_differs_and_the_check_says_so(tiny_llama, caplog):
    """Decode (one row) and prefill (all rows) reduce in another order in float32: the last bits differ."""
    engine = engine_for(tiny_llama, "float32")
    for i, prompt in enumerate(PROMPTS[:4]):
        add(engine, f"r{i}", prompt, sampled(i, 24))
    with caplog.at_level(logging.WARNING, logger="megatron_serve.engine.sampling.logprob_parity"):
        run_out(engine, [])
    counters = engine.stats.counters
    assert counters["logprob_parity_checked"] == 4 and counters["logprob_parity_mismatch"] >= 1
    assert sum("parity mismatch" in r.getMessage() for r in caplog.records) == counters["logprob_parity_mismatch"]


def test_the_requests_checked_are_a_function_of_their_ids(tiny_llama):
    ids = [f"request-{i}" for i in range(4000)]
    share = sum(chosen(i, 0.25) for i in ids) / len(ids)
    assert 0.22 < share < 0.28 and [chosen(i, 0.25) for i in ids] == [chosen(i, 0.25) for i in ids]
    assert not any(chosen(i, 0.0) for i in ids) and all(chosen(i, 1.0) for i in ids)

    engine = engine_for(tiny_llama, "bfloat16", fraction=0.5)
    names = [f"req-{i}" for i in range(6)]
    for i, name in enumerate(names):
        add(engine, name, PROMPTS[i], sampled(i, 4))
    add(engine, "no-logprobs", PROMPTS[0], SamplingParams(num_tokens_to_generate=4))  # nothing reported: unchecked
    run_out(engine, [])
    expected = sum(chosen(name, 0.5) for name in names)
    assert 0 < expected < len(names)  # these ids split: the fraction is not all-or-nothing
    assert engine.stats.counters["logprob_parity_checked"] == expected


def test_a_refit_voids_the_checks_queued(tiny_llama):
    engine = engine_for(tiny_llama, "bfloat16")
    add(engine, "before-refit", PROMPTS[1], sampled(1, 4))
    while not engine.parity.pending:
        engine.step()
    engine.memory.refit(tiny_llama)  # the same weights, but a new epoch: the check would compare two generations
    run_out(engine, [])
    assert engine.stats.counters["logprob_parity_checked"] == 0 and not engine.parity.pending


def test_a_drained_engine_hands_back_user_requests_only(tiny_llama):
    engine = engine_for(tiny_llama, "bfloat16")
    add(engine, "finished", PROMPTS[1], sampled(1, 2))
    running = add(engine, "running", PROMPTS[2], sampled(2, 50))
    while not engine.parity.pending:  # "finished" finished, its check is queued
        engine.step()
    assert engine.take_unfinished_requests() == [running]  # the check is dropped: no other engine could make it
    assert not engine.parity.pending and not engine.has_unfinished_requests()


def test_the_fraction_is_an_engine_option_checked_and_carried_to_fleet_processes():
    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
    from megatron_serve.fleet.argv import inference_config_to_argv

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = inference_config_from_args(parser.parse_args(["--verify-logprobs-fraction", "0.05"]))
    assert config.verify_logprobs_fraction == 0.05
    assert inference_config_from_args(parser.parse_args(inference_config_to_argv(config))).to_dict() == config.to_dict()
    assert InferenceConfig().verify_logprobs_fraction == 0.0
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(ValueError, match="verify_logprobs_fraction must be a number in \\[0, 1\\]"):
            InferenceConfig(verify_logprobs_fraction=bad)
