"""Long prompts share a step (``long_prefill_token_threshold``, ``max_long_partial_prefills``): the scheduler alone,
over a real block allocator, with steps played by hand (each scheduled count computed, a token sampled where a
sequence's last known token was computed). Each fairness test has its control with the threshold off (0), where
the long prompts that came first take every step's budget until their prefill is done.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args
from megatron_serve.config import InferenceConfig
from megatron_serve.fleet.argv import inference_config_to_argv
from megatron_serve.engine.kv.cache import BlockAllocator
from megatron_serve.engine.scheduler import Scheduler
from megatron_serve.engine.sequence import Sequence
from megatron_serve.wire.request import EngineRequest

BLOCK = 16
BUDGET = 2048


def sequence(name: str, length: int) -> Sequence:
    request = EngineRequest(request_id=name, prompt_tokens=[5 + i % 400 for i in range(length)], arrival_time=0.0)
    return Sequence.of(request, length + 16, frozenset())


def scheduler(threshold: int, long_prefills: int = 1) -> Scheduler:
    return Scheduler(BlockAllocator(8192, enable_prefix_caching=False), BLOCK, max_batch_tokens=BUDGET,
                     max_requests=256, long_prefill_token_threshold=threshold, max_long_partial_prefills=long_prefills)


def step(sched: Scheduler) -> dict[str, int]:
    """Schedule one step and play it: the counts computed, a token sampled for each row that reached its end."""
    batch = sched.schedule()
    for seq, count in batch.entries:
        sampled = count == seq.num_uncomputed
        seq.num_computed += count
        if sampled:
            seq.token_ids.append(7)
    return {seq.request_id: count for seq, count in batch.entries}


def test_a_short_request_arriving_during_a_long_prefill_is_scheduled_in_the_next_step():
    sched = scheduler(threshold=512)
    sched.add(sequence("long", 10_000))
    assert step(sched) == {"long": BUDGET}  # alone, it takes the whole budget (chunked as without the threshold)
    sched.add(sequence("short", 3))
    assert step(sched) == {"short": 3, "long": BUDGET - 3}
    assert step(sched) == {"short": 1, "long": BUDGET - 1}  # its decode, beside the prefill


def test_control_without_the_threshold_the_short_request_waits_for_the_whole_prefill():
    sched = scheduler(threshold=0)
    sched.add(sequence("long", 10_000))
    step(sched)
    sched.add(sequence("short", 3))
    steps = 1
    while "short" not in step(sched):
        steps += 1
    assert steps == 4  # 10,000 tokens at 2,048 a step: five steps, the short request in the last one's leftover


def many_choices_then_short(threshold: int) -> tuple[int, list[dict[str, int]]]:
    """48 choices of a 1,000-token scored prompt (n=48), then a two-token completion: the step the short one is
    first scheduled in, and every step until all prefills are done."""
    sched = scheduler(threshold)
    for index in range(48):
        sched.add(sequence(f"choice{index}", 1000))
    steps = [step(sched)]
    sched.add(sequence("short", 2))
    first = None
    while any(seq.num_computed < 1000 for seq in sched.running if seq.request_id.startswith("choice")) or sched.waiting:
        steps.append(step(sched))
        if first is None and "short" in steps[-1]:
            first = len(steps) - 1
    return first, steps


def test_a_short_request_behind_many_long_waiting_ones_jumps_them():
    first, steps = many_choices_then_short(threshold=512)
    assert first == 1  # the step right after it arrived
    assert all(sum(counts.values()) == BUDGET for counts in steps[:-1])  # every step full: no budget left idle
    control, control_steps = many_choices_then_short(threshold=0)
    assert control >= 23  # behind 48,000 prompt tokens at 2,048 a step
    assert len(steps) <= len(control_steps) + 1


def test_at_most_max_long_partial_prefills_long_prompts_get_a_chunk_before_shorter_ones():
    for long_prefills in (1, 2):
        sched = scheduler(threshold=100, long_prefills=long_prefills)
        for name in ("a", "b", "c"):
            sched.add(sequence(name, 5000))
        sched.add(sequence("short", 50))
        counts = step(sched)
        # the fair pass: `long_prefills` chunks of 100, the short prompt whole; the rest goes to a, then b, in order
        assert counts["short"] == 50
        assert counts["a"] == BUDGET - 50 if long_prefills == 1 else counts["a"] == BUDGET - 50 - 100
        assert counts.get("b", 0) == (0 if long_prefills == 1 else 100)
        assert "c" not in counts


def test_running_decodes_and_a_long_prefill_with_a_long_prompt_waiting():
    sched = scheduler(threshold=256)
    decoding = [sequence(f"d{i}", 4) for i in range(3)]
    for seq in decoding:
        sched.add(seq)
    step(sched)  # their prompts: each samples a first token
    sched.add(sequence("long", 5000))
    sched.add(sequence("next", 5000))
    counts = step(sched)
    assert counts == {"d0": 1, "d1": 1, "d2": 1, "long": BUDGET - 3}
    sched.add(sequence("short", 10))
    counts = step(sched)
    assert counts["short"] == 10 and all(counts[f"d{i}"] == 1 for i in range(3))
    assert counts["long"] == BUDGET - 13 and "next" not in counts  # the running long prompt first, then `next`


def test_preemption_still_frees_the_newest_running_request():
    sched = Scheduler(BlockAllocator(40, enable_prefix_caching=False), BLOCK, max_batch_tokens=BUDGET,
                      max_requests=8, long_prefill_token_threshold=64)
    first, second = sequence("first", 310), sequence("second", 310)
    sched.add(first)
    sched.add(second)
    assert step(sched) == {"first": 310, "second": 310}  # 40 of 40 blocks
    for _ in range(40):  # decodes until the pool is full: the newest is preempted, the oldest keeps going
        batch = sched.schedule()
        if batch.preempted:
            assert [seq.request_id for seq in batch.preempted] == ["second"]
            assert [seq.request_id for seq, _ in batch.entries] == ["first"]
            return
        for seq, count in batch.entries:
            seq.num_computed += count
            seq.token_ids.append(7)
    raise AssertionError("the pool never filled")


def test_the_options_reach_engine_processes_and_bad_values_are_refused_by_name():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert inference_config_from_args(parser.parse_args([])).long_prefill_token_threshold == 2048 // 4
    config = InferenceConfig(device="cpu", long_prefill_token_threshold=0, max_long_partial_prefills=3)
    rebuilt = inference_config_from_args(parser.parse_args(inference_config_to_argv(config)))
    assert (rebuilt.long_prefill_token_threshold, rebuilt.max_long_partial_prefills) == (0, 3)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a non-negative integer"):
        InferenceConfig(device="cpu", long_prefill_token_threshold=-5)
    with pytest.raises(ValueError, match="max_long_partial_prefills must be a positive integer"):
        InferenceConfig(device="cpu", max_long_partial_prefills=0)
