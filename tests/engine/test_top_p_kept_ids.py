"""``return_top_p_token_ids`` in the sampler (slime's top-p patch of SGLang): a row that asks reports the ids its
filters kept (the finite entries of its processed logits, most likely first), which equal transformers' own
``TopKLogitsWarper``/``TopPLogitsWarper`` after its ``TemperatureLogitsWarper`` on the same logits; its log probs are
renormalized over them; a greedy row keeps its token, a row without a subset filter reports none, and a row that does
not ask is sampled and scored as before (the control)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from megatron_serve.engine.sampling.sampler import SampleResult, Sampler
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.wire.sampling_params import SamplingParams

VOCAB = 96


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> SampleResult:
    state = SamplingState(VOCAB, torch.device("cpu"), capacity=len(params))
    keys = [str(row) for row in range(len(params))]
    for key, row_params in zip(keys, params):
        state.add(key, row_params, seed=7, prompt_tokens=[1], output_tokens=[], stop_token_ids=[])
    return Sampler(state).launch(logits, state.rows(keys, [3] * len(keys), [0] * len(keys))).read()


def _kept(processed: torch.Tensor) -> list[int]:
    """The finite entries of one row of processed logits, most likely first (ties by id)."""
    values, order = processed.sort(descending=True, stable=True)
    return order[torch.isfinite(values)].tolist()


def test_kept_ids_are_transformers_warpers_and_log_probs_renormalize_over_them():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    asked = [SamplingParams(temperature=0.8, top_p=0.7, return_top_p_token_ids=True, return_log_probs=True),
             SamplingParams(temperature=0.0, return_top_p_token_ids=True, return_log_probs=True),
             SamplingParams(temperature=0.7, return_top_p_token_ids=True, return_log_probs=True),
             SamplingParams(temperature=0.8, top_p=0.7, return_log_probs=True),
             SamplingParams(temperature=1.0, top_k=5, return_top_p_token_ids=True, return_log_probs=True)]
    out = _sample(logits, asked)
    top_p = TopPLogitsWarper(0.7)(None, TemperatureLogitsWarper(0.8)(None, logits[0:1]))[0]
    top_k = TopKLogitsWarper(5)(None, logits[4:5])[0]
    assert out.kept_ids[0] == _kept(top_p) and 1 < len(out.kept_ids[0]) < VOCAB
    assert out.kept_ids[4] == _kept(top_k) and len(out.kept_ids[4]) == 5
    for row, processed in ((0, top_p), (4, top_k)):
        assert out.token_ids[row] in out.kept_ids[row]
        assert out.log_probs[row] == torch.log_softmax(processed, -1)[out.token_ids[row]].item()
    assert out.kept_ids[1] == [out.token_ids[1]] == [int(logits[1].argmax())]  # greedy: its token alone
    assert out.kept_ids[2] is None and out.kept_ids[3] is None  # no subset filter; did not ask
    raw = torch.log_softmax(logits, -1)
    assert out.log_probs[3] == raw[3, out.token_ids[3]].item()  # control: not asked, the model's log probs
    assert out.log_probs[2] == raw[2, out.token_ids[2]].item() and out.log_probs[1] == raw[1, out.token_ids[1]].item()
    assert out.log_probs[0] > raw[0, out.token_ids[0]].item()  # renormalized over fewer tokens: more likely

    control = _sample(logits, [SamplingParams(temperature=0.8, top_p=0.7, return_log_probs=True)] * 5)
    assert control.kept_ids == [None] * 5 and control.token_ids[0] == out.token_ids[0]  # the same draw
    assert control.log_probs[0] == raw[0, out.token_ids[0]].item()


def test_a_step_without_the_flag_builds_no_kept_ids():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    state = SamplingState(VOCAB, torch.device("cpu"), capacity=2)
    for key in ("a", "b"):
        state.add(key, SamplingParams(temperature=1.0, top_p=0.5), seed=1, prompt_tokens=[1], output_tokens=[],
                  stop_token_ids=[])
    assert Sampler(state).launch(logits, state.rows(["a", "b"], [0, 0], [0, 0])).kept is None
