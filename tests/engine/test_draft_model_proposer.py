"""The draft-model proposer: the target's own greedy tokens when it is the target, the same guesses from a
reused cache as from a fresh one, nothing while stale after a refit, and no draft of another vocabulary."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_serve import DynamicInferenceRequest, InferenceConfig, SamplingParams
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.engine.speculative.draft_model import DraftModelProposer, VocabMismatchError
from megatron_serve.engine.speculative.proposer import DraftInput
from megatron_serve.model.loader import iterate_checkpoint
from megatron_serve.model.tiny import make_tiny_model
from ..prompts import run_to_end

CONFIG = InferenceConfig(device="cpu", dtype="float32")
PROMPTS = [[7, 42, 99, 3, 250, 18, 77], [300], list(range(10, 60)), [5, 5, 5, 5, 9, 9, 9, 9, 11, 12, 13, 14, 15, 16,
                                                                        17, 18, 19, 20]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    return {"target": str(make_tiny_model(root / "target", seed=0)),
            "other": str(make_tiny_model(root / "other", seed=1, hidden_size=32, num_layers=1)),
            "padded": str(make_tiny_model(root / "padded", seed=0, vocab_size=600)),
            "retokenized": str(make_tiny_model(root / "retok", seed=0, tokenizer_vocab_size=400, vocab_size=512))}


def greedy(model_dir: str, prompts: list[list[int]], count: int) -> list[list[int]]:
    return speculative_run(model_dir, None, prompts, count)[0]


def test_a_draft_equal_to_the_target_proposes_the_targets_greedy_tokens(models):
    target = models["target"]
    expected = greedy(target, PROMPTS, 12)
    proposer = DraftModelProposer(target, CONFIG, target_dir=target)
    first = proposer.propose([DraftInput(str(i), p, 4) for i, p in enumerate(PROMPTS)])
    assert first == [tokens[:4] for tokens in expected]
    # every guess accepted plus the target's own token: the next call reuses the whole cache
    second = proposer.propose([DraftInput(str(i), p + e[:5], 6) for i, (p, e) in enumerate(zip(PROMPTS, expected))])
    assert second == [tokens[5:11] for tokens in expected]
    assert proposer.cache.cached_tokens("0") == PROMPTS[0] + expected[0][:10]
    other = greedy(models["other"], PROMPTS, 4)
    assert other != first  # negative control: another model's greedy tokens differ


def test_a_reused_cache_proposes_what_a_fresh_proposer_does(models):
    """Calls with partly accepted guesses, requests joining and leaving, and K varying per request; the reused
    cache starts with one block of 4 tokens, so it grows (copying what it holds) and crosses blocks often."""
    draft = models["other"]
    reused = DraftModelProposer(draft, CONFIG, block_size=4, initial_blocks=1)
    fresh = DraftModelProposer(draft, CONFIG)
    rng = random.Random(0)
    tokens = {str(i): list(prompt) for i, prompt in enumerate(PROMPTS)}
    calls = 0
    for _ in range(8):
        inputs = [DraftInput(rid, list(seq), rng.choice([0, 1, 3, 5])) for rid, seq in tokens.items()]
        guesses = reused.propose(inputs)
        for item in inputs:
            fresh.forget(item.request_id)
        assert guesses == fresh.propose(inputs)
        for item, guess in zip(inputs, guesses):
            if guess:  # the cache holds the request's tokens and all but the last guess, as a fresh one computes them
                assert reused.cache.cached_tokens(item.request_id) == list(item.token_ids) + guess[:-1]
                torch.testing.assert_close(reused.cache.cached_kv(item.request_id),
                                           fresh.cache.cached_kv(item.request_id), rtol=1e-5, atol=1e-5)
        assert [len(g) for g in guesses] == [item.num_tokens for item in inputs]
        calls += sum(bool(g) for g in guesses)
        for item, guess in zip(inputs, guesses):
            accepted = rng.randint(0, len(guess))
            # the target keeps ``accepted`` guesses and adds a token of its own (never the next guess)
            own = (guess[accepted] + 1) % 512 if accepted < len(guess) else rng.randrange(512)
            # and sometimes runs a step without guesses for it (another token past the rejected guess)
            tokens[item.request_id] += guess[:accepted] + [own] + [rng.randrange(512)] * rng.randint(0, 1)
        if "1" in tokens:  # a request leaves midway and another joins
            reused.forget("1")
            del tokens["1"]
            tokens["new"] = [rng.randrange(512) for _ in range(20)]
    assert calls > 10 and reused.cache.num_blocks > 16


def test_a_stale_drafter_proposes_nothing_until_refit_with_the_new_epoch(models):
    other = models["other"]
    proposer = DraftModelProposer(other, CONFIG)
    inputs = [DraftInput("a", PROMPTS[0], 4)]
    before = proposer.propose(inputs)
    assert len(before[0]) == 4
    proposer.on_refit(1)
    assert proposer.stale and proposer.propose(inputs) == [[]]
    retrained = make_tiny_model(f"{other}-retrained", seed=5, hidden_size=32, num_layers=1)
    proposer.load_weights(iterate_checkpoint(retrained), epoch=1)
    after = proposer.propose(inputs)
    assert after == DraftModelProposer(retrained, CONFIG).propose(inputs) and after != before
    # the drafter's tensors may arrive before the engine's refit: stale until both agree
    proposer.load_weights(iterate_checkpoint(other), epoch=2)
    assert proposer.propose(inputs) == [[]]
    proposer.on_refit(2)
    assert proposer.propose(inputs) == before


def test_a_draft_of_another_vocabulary_is_refused(models):
    target = models["target"]
    with pytest.raises(VocabMismatchError, match="vocab_size 600 but the target .* has 512"):
        DraftModelProposer(models["padded"], CONFIG, target_dir=target)
    with pytest.raises(VocabMismatchError, match="another tokenizer than the target"):
        DraftModelProposer(models["retokenized"], CONFIG, target_dir=target)
    DraftModelProposer(models["other"], CONFIG, target_dir=target)  # same tokenizer, smaller model: accepted


def speculative_run(model_dir: str, draft_dir: str | None, prompts: list[list[int]], count: int, k: int = 4
                    ) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens of an engine (with the draft model ``draft_dir`` proposing ``k`` tokens, or none) and its
    speculation counters."""
    config = CONFIG if draft_dir is None else InferenceConfig(
        device="cpu", dtype="float32",
        speculative={"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k,
                     "adaptive": False})  # K pinned: the test counts every draft
    engine = DynamicInferenceEngine.from_model_dir(model_dir, config)
    requests = [DynamicInferenceRequest(str(i), None, prompt, SamplingParams(
        temperature=0.0, num_tokens_to_generate=count, ignore_eos=True)) for i, prompt in enumerate(prompts)]
    run_to_end(engine, requests)
    counters = {key: value for key, value in engine.stats.counters.items() if key.startswith("spec_decode")}
    engine.shutdown()
    return [request.generated_tokens for request in requests], counters


def test_an_engine_whose_draft_is_the_target_accepts_every_draft(models):
    """Issue 39's acceptance: a draft model equal to the target accepts every token it proposes (each verify step
    emits K + 1 tokens), and the output is the engine's own greedy output; another draft model changes the
    acceptance (negative control), never the tokens."""
    target = models["target"]
    expected = greedy(target, PROMPTS, 21)
    tokens, counters = speculative_run(target, target, PROMPTS, 21)
    assert tokens == expected
    assert counters["spec_decode_num_draft_tokens"] > 0
    assert counters["spec_decode_num_accepted_tokens"] == counters["spec_decode_num_draft_tokens"]
    tokens, counters = speculative_run(target, models["other"], PROMPTS, 21)
    assert tokens == expected
    assert counters["spec_decode_num_accepted_tokens"] < counters["spec_decode_num_draft_tokens"]


def test_an_engine_refuses_a_draft_model_of_another_vocabulary(models):
    with pytest.raises(VocabMismatchError):
        speculative_run(models["target"], models["padded"], PROMPTS[:1], 2)
