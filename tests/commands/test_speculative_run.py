"""A real ``run`` with ``--speculative-config`` through the ``openai`` client: the tokens are the plain engine's,
drafts are accepted, and the speculative counters reach ``/metrics``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine

from ..helpers import http_get, metric_by_engine_group, wait_until
from ..prompts import run_to_end
from ..server.conftest import served_run

BIAS = {"133": 7.0, "410": 6.8, "433": 6.9}  # a few favoured tokens: output that repeats, so n-gram guesses land


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_with_speculative_config_serves_the_plain_engines_tokens(tiny_llama, tmp_path):
    speculative = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": false}'
    with served_run(tiny_llama, tmp_path, "--served-model-name", "tiny", "--block-size", "16",
                    "--speculative-config", speculative) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = [5, 17, 5, 17, 5, 17, 99]
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                           logit_bias=BIAS, extra_body={"return_token_ids": True, "ignore_eos": True})
        served = answer.choices[0].token_ids
        plain = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16))
        request = DynamicInferenceRequest("plain", None, prompt, SamplingParams(
            temperature=0.0, num_tokens_to_generate=40, ignore_eos=True, logit_bias={int(k): v for k, v in BIAS.items()}))
        plain.add_request(request)
        while plain.has_unfinished_requests():
            plain.step()
        assert served == request.generated_tokens and len(served) == 40

        def counted(name: str) -> float:  # engines report in heartbeats: the counters arrive a beat later
            lines = [line for line in http_get(f"{url}/metrics", timeout=30).text.splitlines()
                     if line.startswith(name + "{")]
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

        wait_until(lambda: counted("megatron_serve_spec_decode_num_accepted_tokens_total") > 0, 60,
                   "the accepted drafts on /metrics")
        assert counted("megatron_serve_spec_decode_num_accepted_tokens_per_pos_total") == counted(
            "megatron_serve_spec_decode_num_accepted_tokens_total")
        assert counted("vllm:spec_decode_num_drafts_total") > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adaptive_k_in_a_data_parallel_fleet_keeps_each_engines_own_counters(tiny_llama, tmp_path):
    """``run --engines 2`` with the adaptive policy (the default): requests spread over both engines, each
    engine chooses K from its own measurements (its own rows and drafts on /metrics), the tokens are the
    plain engine's."""
    prompts = [[5 + i, 17, 5 + i, 17, 5 + i, 17, 99] for i in range(8)]
    with served_run(tiny_llama, tmp_path, "--served-model-name", "tiny", "--engines", "2", "--block-size", "16",
                    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}') as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def complete(prompt: list[int]) -> list[int]:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                               logit_bias=BIAS,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
            return answer.choices[0].token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:  # all in flight: the least-loaded router uses both engines
            served = list(pool.map(complete, prompts))
        plain = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(block_size_tokens=16))
        requests = [DynamicInferenceRequest(str(i), None, prompt, SamplingParams(
            temperature=0.0, num_tokens_to_generate=32, ignore_eos=True,
            logit_bias={int(k): v for k, v in BIAS.items()})) for i, prompt in enumerate(prompts)]
        run_to_end(plain, requests)
        assert served == [r.generated_tokens for r in requests]

        wait_until(lambda: sum(metric_by_engine_group(url, "megatron_serve_generation_tokens_total").values())
                   == 32 * len(prompts),
                   60, "every generated token counted on /metrics")  # the same heartbeats carry the draft counters
        counted = metric_by_engine_group(url, "megatron_serve_spec_decode_num_rows_total")
        drafts = metric_by_engine_group(url, "megatron_serve_spec_decode_num_draft_tokens_total")
        assert sorted(g for g, n in counted.items() if n > 0) == ["0", "1"]  # both engines ran and chose K
        for group, n in counted.items():
            assert drafts.get(group, 0.0) <= 4 * n  # each engine's mean K, from its own counters, within 0..4
