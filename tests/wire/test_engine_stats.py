"""Engine metrics (``engine_stats``): what the heartbeat's ``metrics`` reports equals what the requests did."""

from __future__ import annotations

import pytest

from megatron_serve import EventType, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.engine_stats import HISTOGRAMS, Histogram

from ..prompts import PROMPTS


def test_counters_and_histograms_match_the_requests_under_preemption(tiny_llama):
    # a tiny pool: constant preemption; every prompt twice: prefix-cache hits
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=4, num_kv_blocks=24, max_batch_tokens=64))
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
    outs = llm.generate(PROMPTS * 2, params)
    report = llm.engine.metrics_snapshot()
    counters, histograms = report["counters"], report["histograms"]
    assert counters["prompt_tokens"] == sum(len(o.prompt_tokens) for o in outs)
    assert counters["generation_tokens"] == sum(len(o.generated_tokens) for o in outs) == 8 * len(outs)
    preemptions = sum(1 for o in outs for e in o.events if e.type is EventType.PREEMPT)
    assert counters["num_preemptions"] == preemptions > 0
    assert counters["prefix_cache_hits"] == llm.engine.load().cached_tokens > 0
    assert counters["prefix_cache_queries"] >= counters["prompt_tokens"]  # re-admissions look up again
    assert report["request_success"] == {"stop": 0, "length": len(outs), "abort": 0}
    counts = {name: sum(h["counts"]) for name, h in histograms.items()}
    assert counts == {"time_to_first_token_seconds": len(outs), "e2e_request_latency_seconds": len(outs),
                      "request_queue_time_seconds": len(outs),
                      "inter_token_latency_seconds": counters["generation_tokens"] - len(outs),
                      "lora_adapter_load_seconds": 0}  # no adapter was loaded
    assert histograms["time_to_first_token_seconds"]["sum"] == pytest.approx(sum(o.ttft for o in outs))
    assert histograms["e2e_request_latency_seconds"]["sum"] == pytest.approx(sum(o.latency for o in outs))
    for name, bounds in HISTOGRAMS.items():
        assert histograms[name]["le"] == list(bounds) and len(histograms[name]["counts"]) == len(bounds) + 1


def test_aborts_are_counted_and_not_timed(tiny_llama):
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=16))
    engine = llm.engine
    from megatron_serve.wire.request import DynamicInferenceRequest

    request = DynamicInferenceRequest("r1", None, [5, 6, 7], SamplingParams(num_tokens_to_generate=50))
    engine.add_request(request)
    engine.step()
    engine.sync()  # its first token is delivered (with overlapped scheduling it is still in flight after a step)
    assert engine.abort_request("r1") is request
    report = engine.metrics_snapshot()
    assert report["request_success"]["abort"] == 1
    assert sum(report["histograms"]["e2e_request_latency_seconds"]["counts"]) == 0
    assert sum(report["histograms"]["time_to_first_token_seconds"]["counts"]) == 1


def test_histogram_buckets_are_inclusive_upper_bounds():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(value)
    h.observe(0.2, times=3)
    assert h.counts == [2, 5, 1] and h.sum == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 0.6)
