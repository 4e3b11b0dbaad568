"""A critical request on a real engine whose every slot runs sheddable ones (docs/tenants.md): its first token comes
out of the very step that gives it a slot (with overlapped scheduling too: that step is read at once, where a request
that finds a free slot gets its token one call later), and every stream, the preempted ones included, ends with
exactly the tokens of an uninterrupted run (greedy), none lost or repeated; and its cached system prompt outlives a
sheddable flood."""

from __future__ import annotations

import msgspec
import pytest

from megatron_serve import DynamicInferenceRequest, EventType, InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.config import SpeculativeConfig
from megatron_serve.engine.core import DynamicInferenceEngine
from megatron_serve.wire.tenancy import TenantTag

from ..prompts import PROMPTS, run_to_end

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=24, ignore_eos=True)
BULK, CHAT = TenantTag("bulk", "sheddable"), TenantTag("chat", "critical")


@pytest.mark.parametrize("async_scheduling, tagged, policy, speculative", [
    (True, True, "fcfs", False), (False, True, "fcfs", False), (True, True, "fcfs", True),
    (True, False, "fcfs", False), (True, False, "priority", False)])
def test_a_critical_requests_first_token_leaves_with_the_step_that_takes_a_slot_and_preempted_streams_are_unchanged(
        tiny_llama, async_scheduling, tagged, policy, speculative):
    """``tagged`` False: the same requests without tenants, the last with priority -5, which waits for a slot under
    the default policy (the control) and preempts as a better class does under vLLM's ``priority`` policy.
    ``speculative``: n-gram speculation on, so that the step read at once may be a verify step. The step that
    displaces computes the critical request alone: the call that reads it gives the others only the tokens of the step
    in flight before it (none without overlap)."""
    preempts = tagged or policy == "priority"
    prompts = PROMPTS[:4] + [PROMPTS[4 % len(PROMPTS)] + " now"]
    reference = [o.generated_tokens for o in MegatronLLM(tiny_llama).generate(prompts, GREEDY)]
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        max_requests=4, block_size_tokens=16, async_scheduling=async_scheduling, scheduling_policy=policy,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                                             prompt_lookup_max=3) if speculative else None))
    requests = [DynamicInferenceRequest(request_id=f"r{i}", prompt=p, prompt_tokens=engine.tokenizer.encode(p),
                                        sampling_params=msgspec.structs.replace(
                                            GREEDY, **({"tenant": BULK if i < 4 else CHAT} if tagged
                                                       else {"priority": 0 if i < 4 else -5})))
                for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def step() -> dict[str, int]:
        outputs = engine.step()
        assert len({out.request_id for out in outputs}) == len(outputs)  # one delta per request (an engine process's)
        for out in outputs:
            tokens[out.request_id] += out.new_tokens
        return {out.request_id: len(out.new_tokens) for out in outputs}

    for request in requests[:4]:
        engine.add_request(request)
    for _ in range(4):
        step()
    assert all(tokens[f"r{i}"] for i in range(4)) and len(engine.scheduler.running) == 4  # every slot: sheddable
    engine.add_request(requests[4])
    steps = 0
    while not tokens["r4"]:
        given = step()
        steps += 1
    assert steps == 1 if preempts else steps > 10  # overlapped, the displacing step is read in its own call
    if preempts and not speculative:  # the displacing step computed r4 alone: the others' tokens are the step before's
        assert given == {"r4": 1, **({f"r{i}": 1 for i in range(4)} if async_scheduling else {})}
    while engine.has_unfinished_requests():
        step()
    assert [tokens[r.request_id] for r in requests] == reference
    assert [r.generated_tokens for r in requests] == reference
    preempted = [r.request_id for r in requests if any(e.type is EventType.PREEMPT for e in r.events)]
    assert preempted == (["r3"] if preempts else [])  # the newest of the worst band (or of the largest value)


def test_control_a_critical_request_in_a_free_slot_keeps_the_overlap(tiny_llama):
    """The control of the step read at once: with a slot free, nothing is displaced, and under overlapped scheduling
    the critical request's first token comes one call after the step that computed it, as every request's does."""
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        max_requests=4, block_size_tokens=16, async_scheduling=True))
    requests = [DynamicInferenceRequest(request_id=f"r{i}", prompt=p, prompt_tokens=engine.tokenizer.encode(p),
                                        sampling_params=msgspec.structs.replace(GREEDY, tenant=BULK if i < 2 else CHAT))
                for i, p in enumerate(PROMPTS[:3])]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests[:2]:
        engine.add_request(request)
    for _ in range(3):
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
    engine.add_request(requests[2])
    steps = 0
    while not tokens["r2"]:
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
        steps += 1
    assert steps == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(e.type is EventType.PREEMPT for r in requests for e in r.events)


@pytest.mark.parametrize("tagged", [True, False])
def test_a_critical_prompts_prefix_cache_hit_survives_a_sheddable_flood(tiny_llama, tagged):
    """A critical request caches its system prompt; a flood of sheddable requests twice the pool's size passes; the
    next critical request finds the prompt cached. ``tagged`` False is the control: untagged (plain LRU), the flood
    evicts it."""
    engine = DynamicInferenceEngine.from_model_dir(tiny_llama, InferenceConfig(
        max_requests=2, block_size_tokens=16, num_kv_blocks=16, max_sequence_length=96))
    system = [30 + i for i in range(48)]
    short = msgspec.structs.replace(GREEDY, num_tokens_to_generate=2)

    def run(name: str, prompts: list[list[int]], tag: TenantTag) -> list[DynamicInferenceRequest]:
        """The requests of ``prompts``, all at once, run to their end."""
        params = msgspec.structs.replace(short, tenant=tag) if tagged else short
        requests = [DynamicInferenceRequest(request_id=f"{name}{i}", prompt=None, prompt_tokens=prompt,
                                            sampling_params=params) for i, prompt in enumerate(prompts)]
        return run_to_end(engine, requests)

    assert run("c0", [system + [5, 6]], CHAT)[0].cached_tokens == 0
    flood = run("f", [[5 + i] + [40 + j % 50 for j in range(62)] for i in range(8)], BULK)  # 4 blocks each
    assert sum(len(r.generated_tokens) for r in flood) == 16  # 8 x 4 blocks through a pool of 16
    assert run("c1", [system + [7, 8]], CHAT)[0].cached_tokens == (48 if tagged else 0)
