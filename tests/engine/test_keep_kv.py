"""Suspend that keeps the KV, and partial rollouts that resume: no token computed twice."""

from __future__ import annotations

import random

import pytest

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model.tiny import make_tiny_model

from ..prompts import run_steps, run_to_end

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=20, ignore_eos=True, return_log_probs=True)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> str:
    """The tiny Llama's shapes with other values: what a trainer's refit brings."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-b"), seed=1, arch="llama"))


def engine(model_dir: str, **kwargs):
    return MegatronLLM(model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=64, max_batch_tokens=256,
                                                  batch_invariant=True, **kwargs)).engine


def prompts(count: int = 3) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, 500) for _ in range(2 * BLOCK + 5 + i)] for i in range(count)]


def run(served, interrupt=None, steps_before: int = 4):
    """Step the prompts to their end; after ``steps_before`` steps, ``interrupt(engine)`` (the verbs)."""
    requests = [DynamicInferenceRequest(str(i), "", p, PARAMS) for i, p in enumerate(prompts())]
    run_steps(served, requests, steps_before)
    served.sync()
    before = served.load().computed_tokens
    if interrupt is not None:
        interrupt(served)
    while served.has_unfinished_requests():
        served.step()
    return requests, before


def test_suspend_with_keep_kv_resumes_bitwise_and_computes_only_the_new_tokens(tiny_llama):
    reference, _ = run(engine(tiny_llama))
    uninterrupted = engine(tiny_llama)
    run(uninterrupted)

    def suspend_keeping(served):
        pool_bytes = served.kv_cache.num_bytes
        assert served.memory.suspend(keep_kv=True) == pool_bytes > 0  # the device pool is released all the same
        assert served.memory.parked is not None and served.memory.parked.num_bytes > 0
        assert served.step() == [] and served.load().running == len(reference)  # still running, nothing computed
        served.memory.resume()

    kept = engine(tiny_llama)
    requests, _ = run(kept, suspend_keeping)
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in reference]
    assert [r.generated_log_probs for r in requests] == [r.generated_log_probs for r in reference]
    assert kept.load().computed_tokens == uninterrupted.load().computed_tokens  # not one token computed twice
    assert kept.memory.parked is None

    control = engine(tiny_llama)  # a plain suspend: the same tokens, but every context computed again
    requests, _ = run(control, lambda served: (served.memory.suspend(), served.memory.resume()))
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in reference]
    assert control.load().computed_tokens > uninterrupted.load().computed_tokens


def continuation_under(model_dir: str, request: DynamicInferenceRequest, upto: int) -> list[int]:
    """What ``model_dir``'s weights generate after the first ``upto`` tokens of ``request``, computed from scratch."""
    served = engine(model_dir)
    again = DynamicInferenceRequest("again", "", list(request.prompt_tokens), PARAMS,
                                    generated_tokens=request.generated_tokens[:upto])
    served.add_request(again)
    while served.has_unfinished_requests():
        served.step()
    return again.generated_tokens[upto:]


def test_a_refit_in_between_recomputes_under_the_new_weights_by_default(tiny_llama, other_weights):
    seen: list[int] = []

    def refit_while_suspended(served):
        seen.extend(r.num_output for r in served.scheduler.running)
        served.memory.suspend(keep_kv=True)
        served.memory.refit(other_weights)
        served.memory.resume()

    recomputing = engine(tiny_llama)
    requests, before = run(recomputing, refit_while_suspended)
    for request, upto in zip(requests, seen):
        assert request.generated_tokens[upto:] == continuation_under(other_weights, request, upto)
        assert set(request.kv_epochs[upto:]) == {1}  # the context was computed again, under epoch 1
    assert recomputing.load().computed_tokens - before > sum(len(r.prompt_tokens) for r in requests)

    seen.clear()
    keeping = engine(tiny_llama, kv_on_refit="keep")
    requests, before = run(keeping, refit_while_suspended)
    assert set(requests[0].kv_epochs[seen[0]:]) == {0}  # it went on over the old weights' KV, and says so
    assert set(requests[0].policy_epochs[seen[0]:]) == {1}
    computed = keeping.load().computed_tokens - before
    assert computed == sum(len(r.generated_tokens) - upto for r, upto in zip(requests, seen))


def cut_rollout(served, prompt: list[int]) -> list[int]:
    """A rollout of ``prompt`` aborted once it generated two blocks (the RL step ends: the rollout is cut where it
    is); the prompt and its tokens, as the trainer resubmits them."""
    rollout = DynamicInferenceRequest("rollout", "", list(prompt), SamplingParams(
        temperature=0.0, num_tokens_to_generate=4 * BLOCK, ignore_eos=True))
    served.add_request(rollout)
    while len(rollout.generated_tokens) < 2 * BLOCK:
        served.step()
    served.sync()
    served.abort_request("rollout")
    return list(prompt) + rollout.generated_tokens


def resumed(served, partial: list[int]) -> DynamicInferenceRequest:
    """``partial`` resubmitted by its token ids and run to its end (8 more tokens)."""
    request = DynamicInferenceRequest("resumed", "", partial, SamplingParams(temperature=0.0, num_tokens_to_generate=8,
                                                                             ignore_eos=True))
    return run_to_end(served, [request])[0]


def test_an_aborted_partial_rollout_resumed_by_token_ids_hits_its_own_blocks(tiny_llama):
    served = engine(tiny_llama)
    partial = cut_rollout(served, prompts(1)[0])
    computed = served.load().computed_tokens
    cached = resumed(served, partial).cached_tokens
    assert cached == (len(partial) - 1) // BLOCK * BLOCK  # prompt and generated blocks, its own
    assert served.load().computed_tokens - computed < BLOCK + 8  # the tail of its last block and the new tokens only



def resumed_after_other_work(model_dir: str, tier_gib: float | None) -> tuple[int, int, int, int]:
    """An aborted rollout resubmitted (prompt + its tokens) after other requests' blocks took the whole device pool
    (64 blocks; the rollout's, freed first, are evicted first): its cached tokens, the most it could find, those
    found in the host tier and the tokens the engine computed for it."""
    served = engine(model_dir, kv_offloading_size=tier_gib)
    partial = cut_rollout(served, prompts(1)[0])
    rng = random.Random(11)
    for index in range(5):  # 5 x 16 blocks
        other = [rng.randrange(5, 500) for _ in range(16 * BLOCK)]
        run_to_end(served, [DynamicInferenceRequest(f"other-{index}", "", other, SamplingParams(
            temperature=0.0, num_tokens_to_generate=1, ignore_eos=True))])
    from_host, computed = served.scheduler.host_cached_tokens, served.load().computed_tokens
    resumed_request = resumed(served, partial)
    return (resumed_request.cached_tokens, (len(partial) - 1) // BLOCK * BLOCK,
            served.scheduler.host_cached_tokens - from_host, served.load().computed_tokens - computed)


def test_a_partial_rollout_whose_blocks_left_the_device_pool_finds_them_in_the_host_tier(tiny_llama):
    cached, cacheable, from_host, computed = resumed_after_other_work(tiny_llama, 0.01)
    assert cached == cacheable > 3 * BLOCK  # prompt and generated blocks, every one
    assert from_host == cached  # from the host tier, copied back
    assert computed < BLOCK + 8  # the tail of its last block and the new tokens only
    cached, _, from_host, computed = resumed_after_other_work(tiny_llama, None)  # the control: no tier
    assert cached == from_host == 0 and computed > cacheable
