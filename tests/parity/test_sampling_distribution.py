"""Seeded sampling draws from the right distribution: 5,000 draws against ``transformers``' softmax.

One prompt and an earlier output (the request arrives as a continuation, so the penalties have
output tokens to act on), 5,000 requests with seeds 0..4,999 each drawing the next token, with
every control at once: temperature, min-p, top-k, top-p, repetition / presence / frequency
penalties and logit bias. The expected distribution is ``transformers``' logits for the same
tokens through the same processors, in the engine's order (``reference.sampling_distribution``).

Pearson's chi-square over the tokens expected at least 5 times (the rest pooled in one bin) must
not reject at significance level 0.001, and a token the processors forbid must never be drawn.
The level is what bounds a false failure: a correct engine is rejected with probability 0.001
whatever the number of draws (the bins expected 5 times or more keep the chi-square
approximation). The seeds are fixed, so every run draws the same 5,000 tokens: the test cannot
flake, it passes or fails for a given engine. Measured: 33 tokens survive the filters, each
expected at least 5 times in 5,000 draws as in 20,000; chi-square 33.4 on 32 degrees of freedom,
p = 0.40 (20,000 draws, the count before: 28.9, p = 0.63, at four times the CPU). It also shows it
could fail: the same counts reject the distribution without the temperature (chi-square 256,
p ~ 2e-36) and without the penalties (398, p ~ 2e-65), far below the level.

Float32 on the search's device whatever ``--parity-dtype`` says: in bf16 the engine's and
transformers' probabilities differ by about 1%, which many draws would see.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine import DynamicInferenceEngine
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import run_to_end
from .reference import sampling_distribution

DRAWS = 5_000
SIGNIFICANCE = 1e-3
MIN_EXPECTED = 5.0
PROMPT = [17, 230, 45, 301, 99, 12, 480, 77, 256, 31, 140, 62, 9]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """``(statistic, p-value)`` of observed ``counts`` against ``probs`` (bins expected < 5 pooled)."""
    expected = probs.double() * counts.sum()
    large = expected >= MIN_EXPECTED
    observed_bins = torch.cat([counts[large].double(), counts[~large].double().sum()[None]])
    expected_bins = torch.cat([expected[large], expected[~large].sum()[None]])
    keep = expected_bins > 0
    observed_bins, expected_bins = observed_bins[keep], expected_bins[keep]
    statistic = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    dof = len(expected_bins) - 1
    return statistic, float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                                    torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def sampling_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("sampling"), seed=11, arch="llama", initializer_range=0.1))


def test_seeded_draws_follow_transformers_softmax(sampling_model, parity):
    device = parity.placement.device
    hf = transformers.AutoModelForCausalLM.from_pretrained(sampling_model, dtype=torch.float32).to(
        device).eval()
    with torch.inference_mode():
        liked = torch.topk(hf(torch.tensor([PROMPT], device=device)).logits[0, -1], 4).indices.tolist()
        earlier = [liked[0], liked[1], liked[0], liked[2], liked[0]]  # counts 3, 1, 1: frequency is not presence
        raw = hf(torch.tensor([PROMPT + earlier], device=device)).logits[0, -1].float().cpu()
    params = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
                  frequency_penalty=0.2, logit_bias={liked[3]: 1.5, liked[1]: -1.0},
                  num_tokens_to_generate=len(earlier) + 1)
    expected = sampling_distribution(raw, PROMPT, earlier, SamplingParams(**params))

    engine = DynamicInferenceEngine.from_model_dir(sampling_model, InferenceConfig(
        dtype="float32", device=device, block_size_tokens=16, max_requests=512, max_batch_tokens=4096,
        num_kv_blocks=1100, enable_cuda_graphs=False))
    requests = [DynamicInferenceRequest(str(seed), None, list(PROMPT), SamplingParams(**params, seed=seed),
                                        generated_tokens=list(earlier)) for seed in range(DRAWS)]
    run_to_end(engine, requests)
    drawn = torch.tensor([r.generated_tokens[-1] for r in requests])
    assert all(len(r.generated_tokens) == len(earlier) + 1 for r in requests)
    counts = torch.bincount(drawn, minlength=expected.numel())

    forbidden = ((expected == 0) & (counts > 0)).nonzero().flatten().tolist()
    assert not forbidden, f"tokens the processors forbid were drawn: {forbidden}"
    assert int((expected > 0).sum()) >= 10, "the processors must leave a distribution worth testing"
    statistic, p_value = chi_square(counts, expected)
    assert p_value >= SIGNIFICANCE, f"chi-square {statistic:.1f}: p = {p_value:.2e} < {SIGNIFICANCE}"

    for wrong in (dict(temperature=1.0), dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)):
        other = sampling_distribution(raw, PROMPT, earlier, SamplingParams(**{**params, **wrong}))
        assert chi_square(counts, other)[1] < SIGNIFICANCE, f"the test cannot tell {wrong} apart"
