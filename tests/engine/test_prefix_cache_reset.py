"""RESET_PREFIX_CACHE in the engine (``engine.memory.reset_prefix_cache``, vLLM's ``Scheduler.reset_prefix_cache``):
every cached block of the device pool and the host tier forgotten, told as ``AllBlocksCleared``; refused while
running requests hold blocks, unless they are sent back to be recomputed, and then their tokens are an
uninterrupted run's."""

from __future__ import annotations

import random

from megatron_serve import DynamicInferenceRequest, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.engine.verbs.actions import call
from megatron_serve.wire.kv_events import MEDIUM_DEVICE, MEDIUM_HOST
from megatron_serve.wire.lifecycle import Step
from megatron_serve.wire.messages import ResetPrefixCache

from ..prompts import run_steps

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, return_log_probs=True)


def llm(model_dir: str) -> MegatronLLM:
    """A pool of 24 blocks under a working set of six prompts of five blocks: the host tier holds what it lets go."""
    return MegatronLLM(model_dir, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=24, max_requests=2,
                                                  max_batch_tokens=256, kv_offloading_size=0.01, batch_invariant=True,
                                                  enable_prefix_caching=True))


def prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, 500) for _ in range(5 * BLOCK + 3)] for _ in range(count)]


def one_by_one(served: MegatronLLM, batch: list[list[int]]) -> list:
    return [served.generate([prompt], PARAMS)[0] for prompt in batch]


def reset(served: MegatronLLM, running: bool) -> dict:
    """The verb as the engine process runs it: the verb table's action for the coordinator's message."""
    return call(served.engine, Step.RESET_PREFIX_CACHE, ResetPrefixCache(control_id="r#0",
                                                                          reset_running_requests=running or None))


def test_a_reset_forgets_every_tier_and_the_prompts_are_computed_again_with_the_same_tokens(tiny_llama):
    served = llm(tiny_llama)
    engine = served.engine
    batch = prompts()
    first = one_by_one(served, batch)
    second = one_by_one(served, batch)
    assert [o.cached_tokens for o in second] == [5 * BLOCK] * 6  # control: warm, from the pool and the host tier
    assert engine.kv_events.holds(MEDIUM_HOST) and engine.kv_events.holds(MEDIUM_DEVICE)

    answer = reset(served, running=False)
    assert answer["reset"] is True and answer["forgotten_blocks"] > 0 and answer["recomputed"] == 0
    assert engine.allocator.num_cached == 0
    assert engine.kv_events.holds(MEDIUM_DEVICE) == [] and engine.kv_events.holds(MEDIUM_HOST) == []
    third = one_by_one(served, batch)
    assert [o.cached_tokens for o in third] == [0] * 6
    assert [(o.generated_tokens, o.generated_log_probs) for o in third] == \
        [(o.generated_tokens, o.generated_log_probs) for o in first]


def test_running_requests_refuse_the_reset_unless_they_are_recomputed(tiny_llama):
    reference = llm(tiny_llama).generate(prompts(2), PARAMS)
    served = llm(tiny_llama)
    engine = served.engine
    requests = [DynamicInferenceRequest(str(i), "", p, PARAMS) for i, p in enumerate(prompts(2))]
    run_steps(engine, requests, 2)
    engine.sync()
    cached = engine.allocator.num_cached
    refused = reset(served, running=False)
    assert refused["reset"] is False and refused["held_blocks"] > 0
    assert engine.allocator.num_cached == cached > 0  # nothing forgotten
    answer = reset(served, running=True)
    assert answer == {"reset": True, "forgotten_blocks": cached, "recomputed": 2}
    assert engine.allocator.num_cached == 0 and engine.load().running == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.generated_tokens for r in requests] == [r.generated_tokens for r in reference]
    assert [r.generated_log_probs for r in requests] == [r.generated_log_probs for r in reference]
