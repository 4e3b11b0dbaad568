"""Speculative decoding under tensor parallelism (TP=2, gloo on CPU) and in a data-parallel fleet (two engine
processes behind the coordinator): the tokens are those without speculation, and drafts are really accepted.

Under TP the verify step is one more step plan (its draft rows are prefill-shaped rows, ``num_verify`` in the
packed header) that every rank runs; rank 0 proposes, verifies and rolls back. Batch-invariant mode holds log
probs to ``==``. A draft model runs on rank 0 alone, whole.
"""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.wire.sampling_params import StructuredOutputsParams

from ..devices import tensor_parallel_device
from ..engine.test_speculative import looping, repetitive_prompts
from ..engine.test_speculative_grammar import OBJECTS
from ..helpers import metric_by_engine_group, wait_until
from ..processes import stop_process_group
from ..server.conftest import wait_ready
from ..server.test_openai_e2e import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEVICE = tensor_parallel_device(2)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec-tp"), seed=3, num_heads=4, num_kv_heads=2))


def workload(method: str) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded sampled requests, and one with a JSON grammar. For n-gram, greedy ones whose logit bias
    makes them repeat (prompt lookup's food); a draft model does not see a request's logit bias, so its
    requests go unbiased (the model drafting for itself then guesses the greedy tokens)."""
    prompts = repetitive_prompts(61, 4)
    rng = random.Random(61)
    if method == "ngram":
        free = [looping(rng, num_tokens_to_generate=32, return_log_probs=True, top_n_logprobs=2),
                looping(rng, temperature=0.8, seed=3, num_tokens_to_generate=32, return_log_probs=True),
                looping(rng, num_tokens_to_generate=24, return_log_probs=True)]
    else:
        free = [SamplingParams(temperature=0.0, num_tokens_to_generate=32, ignore_eos=True, return_log_probs=True,
                               top_n_logprobs=2),
                SamplingParams(temperature=0.8, seed=3, num_tokens_to_generate=32, ignore_eos=True,
                               return_log_probs=True),
                SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True, return_log_probs=True)]
    grammar = SamplingParams(temperature=1.0, seed=5, num_tokens_to_generate=60, return_log_probs=True,
                             structured_outputs=StructuredOutputsParams(json=OBJECTS))
    return prompts, [*free, grammar]


def generate(model: str, tp: int, speculative: SpeculativeConfig | None, method: str) -> tuple[list[tuple], int]:
    llm = MegatronLLM(model, InferenceConfig(tensor_parallel_size=tp, block_size_tokens=8, device=DEVICE,
                                             batch_invariant=True, speculative=speculative))
    try:
        prompts, params = workload(method)
        results = llm.generate(prompts, params)
        accepted = llm.engine.stats.counters["spec_decode_num_accepted_tokens"]
        return [(r.generated_tokens, r.generated_log_probs, r.generated_top_n_logprobs, r.finish_reason)
                for r in results], accepted
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_with_speculation_equals_tp2_without(gqa_model, method):
    speculative = (SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, adaptive=False)
                   if method == "ngram" else
                   SpeculativeConfig(method="draft_model", model=gqa_model, num_speculative_tokens=3, adaptive=False))
    plain, _ = generate(gqa_model, 2, None, method)
    spec, accepted = generate(gqa_model, 2, speculative, method)
    assert spec == plain
    assert accepted > 0
    tp1, _ = generate(gqa_model, 1, None, method)
    assert [row[0] for row in spec] == [row[0] for row in tp1]  # and the tokens of one rank alone


def test_a_data_parallel_fleet_with_pinned_k_serves_the_plain_engines_tokens(tiny_llama, tmp_path):
    """``run --engines 2`` with K pinned: both engines verify and accept drafts; greedy and seeded sampled
    requests get the tokens of a plain engine (a request's seeded stream does not depend on its engine)."""
    port = free_port()
    argv = ["run", "--model", tiny_llama, "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--coordinator-port", "0", "--engines", "2", "--log-dir", str(tmp_path / "logs"), "--num-kv-blocks", "128",
            "--block-size", "16", "--health-port", "0",  # no probe port process: not what is tested
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": false}']
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    bias = {"133": 7.0, "410": 6.8, "433": 6.9}  # a few favoured tokens: output that repeats, n-gram guesses land
    jobs = [([5 + i, 17, 5 + i, 17, 5 + i, 17, 99], 0.0 if i % 2 else 0.8, i) for i in range(8)]
    try:
        wait_ready(proc, url, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def complete(job: tuple[list[int], float, int]) -> list[int]:
            prompt, temperature, seed = job
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=temperature,
                                               seed=seed, logit_bias=bias,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
            return answer.choices[0].token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight: the least-loaded router uses both engines
            served = list(pool.map(complete, jobs))
        with MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=16)) as llm:
            plain = llm.generate([prompt for prompt, _, _ in jobs], [SamplingParams(
                temperature=temperature, seed=seed, num_tokens_to_generate=32, ignore_eos=True,
                logit_bias={int(k): v for k, v in bias.items()}) for _, temperature, seed in jobs])
        assert served == [r.generated_tokens for r in plain]

        wait_until(lambda: sum(metric_by_engine_group(url, "megatron_serve_generation_tokens_total").values())
                   == 32 * len(jobs),
                   60, "every generated token counted on /metrics")
        accepted = metric_by_engine_group(url, "megatron_serve_spec_decode_num_accepted_tokens_total")
        assert sorted(g for g, n in accepted.items() if n > 0) == ["0", "1"]  # both engines accepted drafts
    finally:
        stop_process_group(proc)
