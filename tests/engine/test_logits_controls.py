"""Penalties, logit bias, min_tokens, stop_token_ids and min_p: batched in the engine, neutral when unused."""

from __future__ import annotations

import pytest
import torch

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.sampling.filters import FilterRows, filtered_logits
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.engine.sampling.logits_processors import apply_controls, apply_token_bitmask, unpack_bitmask

from ..prompts import PROMPTS, run_requests

GREEDY = dict(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=16))


def test_neutral_controls_leave_greedy_output_unchanged_beside_rows_that_use_them(llm):
    """Rows whose controls are neutral share each step with rows whose controls are not, so the batched controls
    run on every step; the neutral rows' tokens and log probs are the plain run's, bit for bit. The control: the
    other rows' tokens differ from their plain run's (the controls did run)."""
    plain = llm.generate(PROMPTS, SamplingParams(**GREEDY, return_log_probs=True))
    neutral = SamplingParams(**GREEDY, return_log_probs=True, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, logit_bias={}, min_p=0.0, min_tokens=0, stop_token_ids=[])
    used = SamplingParams(**GREEDY, return_log_probs=True, presence_penalty=1.5, frequency_penalty=0.5,
                          repetition_penalty=1.3, min_p=0.05)
    results = run_requests(llm.engine, [(p, neutral if i % 2 == 0 else used) for i, p in enumerate(PROMPTS)])
    assert [r.generated_tokens for r in results[0::2]] == [o.generated_tokens for o in plain[0::2]]
    assert [r.generated_log_probs for r in results[0::2]] == [o.generated_log_probs for o in plain[0::2]]
    assert [r.generated_tokens for r in results[1::2]] != [o.generated_tokens for o in plain[1::2]]


def test_logit_bias_makes_every_token_the_biased_one_in_a_mixed_batch(llm):
    target = llm.engine.tokenizer.encode(" fox", add_special_tokens=False)[0]
    biased = SamplingParams(**GREEDY, logit_bias={target: 100.0})
    free = SamplingParams(**GREEDY)
    plain = llm.generate(PROMPTS[:4], free)
    results = run_requests(llm.engine, list(zip(PROMPTS[:4], [biased, free, biased, free])))
    assert all(t == target for r in results[0::2] for t in r.generated_tokens)
    assert [r.generated_tokens for r in results[1::2]] == [o.generated_tokens for o in plain[1::2]]


def test_large_presence_penalty_never_repeats_a_token(llm):
    outs = llm.generate(PROMPTS, SamplingParams(**{**GREEDY, "num_tokens_to_generate": 40}, presence_penalty=2.0,
                                                logit_bias=None))
    plain = llm.generate(PROMPTS, SamplingParams(**{**GREEDY, "num_tokens_to_generate": 40}))
    # greedy on a random model repeats itself; a +2 logit gap is enough to forbid it on this model's logit scale
    assert any(len(set(o.generated_tokens)) < len(o.generated_tokens) for o in plain)
    for out in outs:
        assert len(set(out.generated_tokens)) == len(out.generated_tokens), out.generated_tokens


def test_min_tokens_holds_off_the_stop_token_and_stop_token_ids_end_generation(llm):
    first = llm.generate(PROMPTS[0], SamplingParams(**GREEDY))[0].generated_tokens
    stop_on = first[3]
    stopped = llm.generate(PROMPTS[0], SamplingParams(**GREEDY, stop_token_ids=[stop_on]))[0]
    assert stopped.generated_tokens == first[: first.index(stop_on) + 1]  # the stop token last, as in vLLM
    assert stopped.finish_reason.value == "stop"
    held = llm.generate(PROMPTS[0], SamplingParams(**GREEDY, stop_token_ids=[stop_on], min_tokens=10))[0]
    assert stop_on not in held.generated_tokens[:10]
    assert len(held.generated_tokens) >= 10


def controlled(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], list[int], frozenset[int]]]
               ) -> torch.Tensor:
    """``apply_controls`` over one request per row: (params, prompt, output so far, stop token ids)."""
    state = SamplingState(logits.shape[-1], torch.device("cpu"))
    for index, (params, prompt, output, stop) in enumerate(rows):
        state.add(str(index), params, 0, prompt, output, stop)
    step = state.rows([str(i) for i in range(len(rows))], [0] * len(rows), [len(row[2]) for row in rows])
    return apply_controls(logits, state, step)


def test_controls_match_a_row_by_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], [3, 3, 4], frozenset()),
            (SamplingParams(), [1], [5], frozenset({7})),
            (SamplingParams(repetition_penalty=1.5, logit_bias={9: -3.0}, min_tokens=2), [2, 8], [6],
             frozenset({0, 7}))]
    out = controlled(logits, rows)
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 2 * 0.25
    expected[0, 4] -= 0.5 + 0.25
    expected[2, 9] -= 3.0
    expected[2, [0, 7]] = float("-inf")
    for token in (2, 8, 6):
        value = expected[2, token]
        expected[2, token] = value / 1.5 if value > 0 else value * 1.5
    torch.testing.assert_close(out, expected)
    assert controlled(logits, [(SamplingParams(), [], [], frozenset())] * 3) is logits


def test_bitmask_unpacks_every_bit_including_the_sign_bit():
    vocab = 70
    allowed = {0, 5, 31, 32, 63, 69}
    words = torch.zeros((1, 3), dtype=torch.int64)
    for token in allowed:
        words[0, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert set(unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()) == allowed
    logits = apply_token_bitmask(torch.zeros(2, vocab), torch.cat([torch.full_like(bitmask, -1), bitmask]))
    assert torch.isfinite(logits[0]).all()
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.5, 0.3, 0.2, 0.0]]).log()
    min_p = torch.tensor([0.5, 0.0])
    probs = filtered_logits(logits, FilterRows({"min_p": min_p}.__getitem__, frozenset({"min_p"}), 0)).softmax(-1)
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.3, 0.2, 0.0]))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "num_tokens_to_generate": 10}, "min_tokens"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"return_prompt_log_probs": 1}, "return_prompt_log_probs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
])
def test_bad_extension_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_extensions_round_trip_the_wire_and_neutral_ones_stay_off_it():
    params = SamplingParams(logit_bias={7: -2.5}, stop_token_ids=[3], min_tokens=2, return_prompt_log_probs=True,
                            structured_outputs={"json": {"type": "object"}})
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert set(SamplingParams().to_dict()) == {"temperature", "top_k", "top_p", "num_tokens_to_generate", "stop_words",
                                               "termination_id", "ignore_eos", "return_log_probs", "top_n_logprobs",
                                               "seed"}


def test_penalty_counts_grow_on_the_device_and_a_reused_slot_starts_from_its_own_tokens():
    state = SamplingState(8, torch.device("cpu"), capacity=1)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    state.add("a", penalised, 0, [], [2], ())
    rows = state.rows(["a"], [0], [1])
    state.add_counts(rows, torch.tensor([2]))  # the token the device sampled for it
    assert apply_controls(torch.zeros(1, 8), state, rows)[0, 2] == -2.0  # the token given at binding, and the new one
    state.remove("a")
    state.add("b", penalised, 0, [], [5], ())  # the freed slot and control row, bound again
    out = apply_controls(torch.zeros(1, 8), state, state.rows(["b"], [0], [1]))
    assert out[0].tolist() == [0.0] * 5 + [-1.0] + [0.0] * 2
