"""The batched sampler: filters per row, seeded rows independent of their batch, log probs and top-n."""

from __future__ import annotations

import pytest
import torch

from megatron_serve.engine.sampling.sampler import SampleResult, Sampler
from megatron_serve.engine.sampling.sampling_state import SamplingState
from megatron_serve.wire.sampling_params import SamplingParams

VOCAB = 12
# Distinct, well separated probabilities: token t has logit t / 2, so token 11 is the most likely.
LOGITS = torch.arange(VOCAB, dtype=torch.float32) / 2


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           logprobs_mode: str = "raw_logprobs") -> SampleResult:
    """Each row a request of its own (an unseeded one seeded by its row number), sampled in one batch."""
    state = SamplingState(logits.shape[-1], torch.device("cpu"))
    for row, sp in enumerate(params):
        state.add(str(row), sp, row if sp.seed is None else sp.seed, [], [], ())
    rows = state.rows([str(row) for row in range(len(params))], positions, [0] * len(params))
    return Sampler(state, logprobs_mode).launch(logits, rows).read()


def draw_many(params: SamplingParams, rows: int = 4000) -> torch.Tensor:
    result = sample(LOGITS.expand(rows, VOCAB).clone(), [params] * rows, [0] * rows)
    return torch.tensor(result.token_ids)


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def test_temperature_sampling_follows_the_softmax():
    got = frequencies(draw_many(SamplingParams(temperature=1.0)))
    torch.testing.assert_close(got, LOGITS.softmax(-1), atol=0.03, rtol=0)


def test_top_k_keeps_exactly_the_k_most_likely_renormalized():
    got = frequencies(draw_many(SamplingParams(temperature=1.0, top_k=3)))
    want = torch.zeros(VOCAB)
    want[-3:] = LOGITS[-3:].softmax(-1)
    assert set(torch.nonzero(got).flatten().tolist()) == {9, 10, 11}
    torch.testing.assert_close(got, want, atol=0.03, rtol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = LOGITS.softmax(-1)  # sorted descending: 11, 10, 9, ...
    mass_of_top_two = float(probs[-2:].sum())
    got = frequencies(draw_many(SamplingParams(temperature=1.0, top_p=mass_of_top_two - 0.01)))
    assert set(torch.nonzero(got).flatten().tolist()) == {10, 11}
    want = torch.zeros(VOCAB)
    want[-2:] = probs[-2:] / probs[-2:].sum()
    torch.testing.assert_close(got, want, atol=0.03, rtol=0)


def test_a_mixed_batch_treats_each_row_by_its_own_parameters():
    greedy = SamplingParams(temperature=0.0, return_log_probs=True, top_n_logprobs=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, return_log_probs=True)
    degenerate = SamplingParams(temperature=5e-324, top_p=0.5)  # logits / temperature overflow
    tight = SamplingParams(temperature=1.0, top_k=1)
    shuffled = LOGITS[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))]
    batch = torch.stack([LOGITS, shuffled, LOGITS, shuffled, LOGITS])
    params = [greedy, seeded, degenerate, tight, SamplingParams(temperature=2.0, seed=9)]

    result = sample(batch, params, [0, 4, 0, 0, 7])

    assert result.token_ids[0] == 11
    assert result.token_ids[2] == 11  # no finite distribution: the greedy choice, not an error
    assert result.token_ids[3] == int(shuffled.argmax())
    alone = sample(shuffled[None], [seeded], [4])
    assert result.token_ids[1] == alone.token_ids[0]  # a seeded row ignores its batch
    log_probs = batch.log_softmax(-1)
    assert result.log_probs[0] == pytest.approx(float(log_probs[0, 11]))
    assert result.log_probs[1] == pytest.approx(float(log_probs[1, result.token_ids[1]]))
    assert result.log_probs[2] is None
    assert result.top_ids[0] == [11, 10]
    assert result.top_log_probs[0] == pytest.approx([float(log_probs[0, 11]), float(log_probs[0, 10])])
    assert result.top_ids[1] is None and result.top_log_probs[1] is None


def test_seeded_draws_change_with_the_position_and_repeat_with_it():
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(LOGITS[None].clone(), [params], [index]).token_ids[0] for index in range(40)]
    again = [sample(LOGITS[None].clone(), [params], [index]).token_ids[0] for index in range(40)]
    assert draws == again
    assert len(set(draws)) > 3


def test_the_draws_are_the_hash_formula_whatever_the_chunking(monkeypatch):
    """``gumbel_argmax`` goes through a CPU batch in chunks of rows, and skips the finite check where every row
    samples the logits as they are: each token is still ``argmax(logits + g)`` for the noise of the formula in
    one pass (``-log(-log u)``, ``u`` from the hash of the row's key and the token's), or the logits' argmax
    for a row without a finite maximum (NaN, infinite, all -inf)."""
    from megatron_serve.engine.sampling import sampler
    from megatron_serve.engine.sampling.sampling_state import MASK32, fmix32

    rows, vocab = 7, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, 5], logits[1, 9] = float("inf"), float("inf")
    logits[2] = float("-inf")
    logits[3, 7] = float("nan")
    state = SamplingState(vocab, torch.device("cpu"), rows)
    for row in range(rows):
        state.add(str(row), SamplingParams(temperature=1.0, seed=100 + row), 100 + row, [], [], ())

    def draw(positions: list[int]) -> list[int]:
        step = state.rows([str(row) for row in range(rows)], positions, [0] * rows)
        return Sampler(state).launch(logits, step).read().token_ids

    def formula(positions: list[int]) -> list[int]:
        step = state.rows([str(row) for row in range(rows)], positions, [0] * rows)
        keys = fmix32(state.vector("seed_key")[step.slot] ^ fmix32((step.position * 0x9E3779B9) & MASK32))
        bits = fmix32(keys[:, None] ^ state.token_keys[None, :]) >> 8
        noise = -torch.log(-torch.log((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))))
        finite = torch.isfinite(logits.amax(-1))
        return torch.where(finite, torch.argmax(logits + noise, -1), torch.argmax(logits, -1)).tolist()

    positions = list(range(20, 20 + rows))
    expected = formula(positions)
    assert expected[1:4] == [5, 0, 7]  # the rows without a finite maximum: their logits' first maximum or NaN
    for chunk in (vocab, 3 * vocab, 1 << 15):  # a row, three rows, the whole batch at a time
        monkeypatch.setattr(sampler, "_CHUNK", chunk)
        assert draw(positions) == expected
    moved = [p + 1 for p in positions]
    assert draw(moved) == formula(moved) != expected  # the draws follow the position (the test can fail)
