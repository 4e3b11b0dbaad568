"""The scheduler alone, with no model (vLLM's ``tests/v1/core/test_scheduler.py``): requests added through its
admission checks, aborted, scheduled over a real block allocator, and steps played by hand: each scheduled count
"computed", and fake step outputs (the tokens a device would have sampled) handed to ``update_from_output``."""

from __future__ import annotations

import time

import pytest

from megatron_serve.engine.admission import Admission
from megatron_serve.engine.kv.cache import BlockAllocator
from megatron_serve.engine.scheduler import ScheduledBatch, Scheduler
from megatron_serve.engine.sequence import Sequence
from megatron_serve.engine.drafts import mark_in_flight
from megatron_serve.engine.steps import Emitted
from megatron_serve.engine.steps import InFlightStep, StepOutput
from megatron_serve.model.config import ModelConfig
from megatron_serve.wire.request import EngineRequest, EventType, FinishReason, RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams, StructuredOutputsParams

BLOCK = 4
VOCAB = 100
EOS = 2
MODEL = ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=VOCAB, hidden_size=8,
                    intermediate_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                    max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False, qk_norm=False)


def scheduler(num_blocks: int = 64, budget: int = 64, max_requests: int = 8, prefix_caching: bool = False,
              threshold: int = 0, max_sequence_length: int = 128, scheduling_policy: str = "fcfs") -> Scheduler:
    admission = Admission(MODEL, max_sequence_length, BLOCK, num_blocks, (EOS,), seed=0)
    return Scheduler(BlockAllocator(num_blocks, enable_prefix_caching=prefix_caching), BLOCK, budget, max_requests,
                     threshold, admission=admission, scheduling_policy=scheduling_policy)


def request(name: str, prompt: list[int] | int, **params) -> EngineRequest:
    tokens = prompt if isinstance(prompt, list) else [10 + i % 50 for i in range(prompt)]
    params.setdefault("num_tokens_to_generate", 8)
    return EngineRequest(request_id=name, prompt_tokens=tokens, sampling_params=SamplingParams(**params),
                         arrival_time=time.time())


def launch(sched: Scheduler, batch: ScheduledBatch, epoch: int = 0) -> InFlightStep:
    """What the engine's launch and sample do to the sequences: the counts computed, a token pending per sampling
    row (a row samples when it computes its last known token)."""
    sampling = [s for s, count in batch.entries if count == s.num_uncomputed]
    starts = [s.num_computed for s, _ in batch.entries]
    for sequence, count in batch.entries:
        sequence.kv_epoch = epoch if sequence.kv_epoch is None else sequence.kv_epoch
        sequence.num_computed += count
    for sequence in sampling:
        sequence.pending_tokens += 1
    return InFlightStep(batch.entries, starts, sampling, [epoch] * len(sampling), None, None, None,
                        [s.num_computed for s in sampling], [s.num_generated for s in sampling])


def play(sched: Scheduler, tokens: dict[str, int] | int = 7) -> tuple[dict[str, int], list[StepOutput]]:
    """Schedule one step, launch it and read it back with ``tokens`` sampled (one for every row, or by id)."""
    batch = sched.schedule()
    step = launch(sched, batch)
    sampled = [tokens if isinstance(tokens, int) else tokens[s.request_id] for s in step.sampling]
    outputs = sched.update_from_output(step, [Emitted([t], [-0.5], [None], [None]) for t in sampled])
    return {s.request_id: count for s, count in batch.entries}, outputs


def started(*requests: EngineRequest, num_blocks: int = 64) -> Scheduler:
    """A scheduler of ``num_blocks`` blocks that has admitted ``requests`` and played one step of them (:func:`play`:
    each prompt computed, token 7 sampled)."""
    sched = scheduler(num_blocks=num_blocks)
    for each in requests:
        sched.add_request(each)
    play(sched)
    return sched


def test_add_queues_a_request_with_its_stop_ids_and_a_seed():
    sched = scheduler()
    first, second = request("a", 5), request("b", 5, seed=11, stop_token_ids=[3], ignore_eos=True)
    sched.add_request(first)
    sched.add_request(second)
    assert [s.request_id for s in sched.waiting] == ["a", "b"] and set(sched.requests) == {"a", "b"}
    added = sched.requests["a"]
    assert added.status is RequestStatus.WAITING_IN_QUEUE and [e.type for e in added.events] == [EventType.ADD]
    assert sched.requests["a"].stop_token_ids == {EOS} and sched.requests["b"].stop_token_ids == {3}
    assert sched.requests["b"].seed == 11 and sched.pending == []


def test_a_request_that_can_never_run_fails_alone_with_the_reason():
    sched = scheduler(num_blocks=4, max_sequence_length=64)
    bad = [request("empty", []), request("vocab", [5, VOCAB]), request("long", 64),
           request("blocks", 10, num_tokens_to_generate=20), request("a", 5), request("a", 6)]
    for r in bad:
        sched.add_request(r)
    failed = sched.take_pending()
    assert [out.request_id for out in failed] == ["empty", "vocab", "long", "blocks", "a"]
    assert all(out.finished and out.new_tokens == [] and out.final.status is RequestStatus.FAILED for out in failed)
    errors = [out.final.error for out in failed]
    assert errors[0] == "prompt is empty" and "outside the vocabulary" in errors[1]
    assert "max_sequence_length" in errors[2] and "KV blocks" in errors[3] and "already in this engine" in errors[4]
    assert [s.request_id for s in sched.waiting] == ["a"]  # the first "a" was admitted, its duplicate was not


def test_a_request_with_a_grammar_fails_on_a_scheduler_that_takes_none():
    sched = scheduler()
    sched.add_request(request("g", 5, structured_outputs=StructuredOutputsParams(json={"type": "object"})))
    (out,) = sched.take_pending()
    assert out.final.status is RequestStatus.FAILED and "structured outputs" in out.final.error


def test_abort_frees_a_running_requests_blocks_and_an_unknown_id_is_none():
    sched = started(request("a", 9), request("b", 5), num_blocks=16)
    assert sched.allocator.num_free == 16 - 3 - 2
    aborted = sched.abort_request("a")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert aborted.status is RequestStatus.FAILED and "a" not in sched.requests
    assert sched.allocator.num_free == 16 - 2 and [s.request_id for s in sched.running] == ["b"]
    assert sched.abort_request("a") is None and sched.abort_request("nobody") is None


def test_abort_of_a_waiting_request_takes_it_off_the_queue():
    sched = scheduler()
    sched.add_request(request("a", 5))
    sched.abort_request("a")
    assert not sched.has_work() and sched.schedule().entries == []


def test_a_row_of_a_request_aborted_while_its_step_was_in_flight_is_dropped():
    sched = scheduler()
    sched.add_request(request("a", 5))
    sched.add_request(request("b", 5))
    step = launch(sched, sched.schedule())
    sched.abort_request("a")
    outputs = sched.update_from_output(step, [Emitted([7], [None], [None], [None]),
                                              Emitted([8], [None], [None], [None])])
    assert [(out.request_id, out.new_tokens) for out in outputs] == [("b", [8])]


def test_the_token_budget_chunks_a_long_prompt_and_decodes_go_first():
    sched = scheduler(budget=16)
    sched.add_request(request("short", 3))
    sched.add_request(request("long", 40))
    assert play(sched)[0] == {"short": 3, "long": 13}
    counts, outputs = play(sched)
    assert counts == {"short": 1, "long": 15}  # the decode token first, the prompt's next chunk after it
    assert list(counts) == ["short", "long"] and [out.request_id for out in outputs] == ["short"]
    assert play(sched)[0] == {"short": 1, "long": 12}  # the last chunk samples the long prompt's first token
    assert sched.requests["long"].output_tokens == [7]


def test_max_requests_caps_the_running_requests():
    sched = scheduler(max_requests=2)
    for name in "abc":
        sched.add_request(request(name, 4))
    assert set(play(sched)[0]) == {"a", "b"}
    sched.abort_request("a")
    assert set(play(sched)[0]) == {"b", "c"}


def test_priority_orders_admission_then_arrival():
    sched = scheduler(max_requests=2)
    sched.add_request(request("late", 4, priority=5))
    sched.add_request(request("first", 4, priority=-1))
    sched.add_request(request("second", 4, priority=-1))
    assert list(play(sched)[0]) == ["first", "second"]
    assert [s.request_id for s in sched.waiting] == ["late"]


def test_when_blocks_run_out_the_newest_running_request_is_preempted_and_recomputed_first():
    sched = scheduler(num_blocks=6, budget=64)
    sched.add_request(request("old", 12))  # 3 blocks, the fourth for its 13th token
    sched.add_request(request("new", 12))
    play(sched)
    assert sched.allocator.num_free == 0
    counts, _ = play(sched)  # "old" grows into a fourth block: "new" gives its three back
    new = sched.requests["new"]
    assert counts == {"old": 1} and new.num_computed == 0 and new.block_table == []
    assert [s.request_id for s in sched.waiting] == ["new"] and new.events[-1].type is EventType.PREEMPT
    assert new.output_tokens == [7] and new.num_uncomputed == 13  # its prompt and its token, again


def test_a_prefix_cached_by_a_finished_request_is_found_by_the_next():
    sched = scheduler(prefix_caching=True)
    prompt = list(range(10, 23))  # 13 tokens: three complete blocks
    sched.add_request(request("a", prompt, num_tokens_to_generate=1))
    _, outputs = play(sched)
    assert outputs[0].finished and sched.requests == {}
    sched.add_request(request("b", prompt + [40, 41]))
    counts, _ = play(sched)
    assert counts == {"b": 15 - 12} and sched.cached_tokens == 12
    assert sched.running[0].cached_tokens == 12


def test_a_prefix_with_another_cache_salt_or_epoch_is_not_found():
    sched = scheduler(prefix_caching=True)
    prompt = list(range(10, 23))
    sched.add_request(request("a", prompt, num_tokens_to_generate=1))
    play(sched)
    sched.add_request(request("salted", prompt, cache_salt="other", num_tokens_to_generate=1))
    assert play(sched)[0] == {"salted": 13}
    sched.epoch += 1  # a refit: the old weights' blocks are not the new ones'
    sched.add_request(request("b", prompt))
    assert play(sched)[0] == {"b": 13} and sched.cached_tokens == 0


def test_a_stop_id_finishes_the_request_and_stays_its_last_token():
    """vLLM's and SGLang's outputs end with the stop id, counted and with its log prob (the engine dropped it:
    ``new_tokens == []`` then, and a trainer's next turn lacked the template's end token)."""
    sched = scheduler()
    sched.add_request(request("a", 5, stop_token_ids=[9]))
    forgotten: list[str] = []
    sched.forgets.append(forgotten.append)
    sequence = sched.requests["a"]
    _, (out,) = play(sched, 7)
    assert out.new_tokens == [7] and out.new_log_probs == [-0.5] and not out.finished and not out.stop_token
    _, (out,) = play(sched, 9)
    assert out.finished and out.stop_token and out.new_tokens == [9] and out.new_log_probs == [-0.5]
    assert sequence.output_tokens == [7, 9] and sequence.num_output == 2
    assert out.final.finish_reason is FinishReason.STOP and out.final.status is RequestStatus.COMPLETED
    assert forgotten == ["a"] and sched.allocator.num_free == sched.allocator.num_blocks and not sched.has_work()


def test_eos_stops_unless_ignored_and_length_ends_at_num_tokens_to_generate():
    sched = scheduler()
    sched.add_request(request("eos", 5))
    sched.add_request(request("ignored", 5, ignore_eos=True, num_tokens_to_generate=2))
    ignored = sched.requests["ignored"]
    _, outputs = play(sched, EOS)
    assert [(o.request_id, o.new_tokens, o.finished, o.stop_token) for o in outputs] == [
        ("eos", [EOS], True, True), ("ignored", [EOS], False, False)]
    _, (out,) = play(sched, EOS)
    assert out.finished and out.final.finish_reason is FinishReason.LENGTH and not out.stop_token
    assert ignored.output_tokens == [EOS, EOS]


def test_a_stop_id_at_the_length_limit_is_a_stop():
    """vLLM's check_stop looks at the stop ids before the length."""
    sched = scheduler()
    sched.add_request(request("a", 5, num_tokens_to_generate=1))
    _, (out,) = play(sched, EOS)
    assert out.new_tokens == [EOS] and out.final.finish_reason is FinishReason.STOP


def test_a_continuation_that_brings_its_stop_token_ends_without_generating():
    """A request resubmitted with the tokens its client has, the stop token last (the end was lost on the way):
    nothing is generated after it, nothing doubled. A continuation whose stop id is held off by min_tokens goes on."""
    sched = scheduler()
    brought = EngineRequest(request_id="a", prompt_tokens=[10, 11, 12], generated_tokens=[7, EOS],
                            sampling_params=SamplingParams(num_tokens_to_generate=8), arrival_time=time.time())
    sched.add_request(brought)
    (out,) = sched.pending
    assert out.finished and out.new_tokens == [] and out.final.finish_reason is FinishReason.STOP
    assert "a" not in sched.requests and not sched.has_work()
    held = EngineRequest(request_id="b", prompt_tokens=[10, 11, 12], generated_tokens=[7, EOS],
                         sampling_params=SamplingParams(num_tokens_to_generate=8, min_tokens=3),
                         arrival_time=time.time())
    sched.add_request(held)
    assert "b" in sched.requests


def test_update_from_output_records_each_tokens_epochs():
    sched = scheduler()
    sched.add_request(request("a", 5))
    _, (first,) = play(sched)
    sched.epoch = 3  # a refit between the steps: the KV stays under epoch 0 (the step records its own)
    step = launch(sched, sched.schedule(), epoch=0)
    (second,) = sched.update_from_output(step, [Emitted([8], [None], [None], [None])])
    assert sched.requests["a"].output_tokens == [7, 8] and (first.new_tokens, second.new_tokens) == ([7], [8])
    assert (first.epochs, second.epochs) == ((0, 0, -1), (3, 0, -1))  # (policy, KV, adapter) of each one's tokens
    assert (first.new_log_probs, second.new_log_probs) == ([-0.5], [])


def _verify_step(sched: Scheduler, drafts: list[int]) -> InFlightStep:
    """A verify step for the one running request: its drafts appended and scheduled as extra rows."""
    (sequence,) = sched.running
    sequence.token_ids.extend(drafts)
    sequence.num_drafts = len(drafts)
    batch = sched.schedule()
    assert batch.entries == [(sequence, 1 + len(drafts))]
    step = launch(sched, batch)
    sequence.pending_tokens -= 1  # mark_in_flight counts the verify step's pending token itself
    mark_in_flight(step.sampling, [len(drafts)])
    step.drafts = [len(drafts)]
    return step


@pytest.mark.parametrize("accepted", [0, 3])
def test_rejected_drafts_are_rolled_back_and_their_blocks_freed(accepted):
    sched = started(request("a", 3, num_tokens_to_generate=20), num_blocks=16)
    drafts = [30, 31, 32, 33, 34, 35]
    step = _verify_step(sched, drafts)
    sequence = sched.running[0]
    assert sequence.num_computed == 10 and len(sequence.block_table) == 3 and sched.allocator.num_free == 13
    nothing = [None] * (accepted + 1)
    emitted = Emitted([*drafts[:accepted], 50], nothing, nothing, nothing, accepted)
    (out,) = sched.update_from_output(step, [emitted])
    assert out.new_tokens == [*drafts[:accepted], 50]
    assert sequence.token_ids == [10, 11, 12, 7, *drafts[:accepted], 50] and sequence.drafts_in_flight == 0
    assert sequence.num_computed == 4 + accepted  # the rejected drafts' KV is not kept; the bonus token's is to come
    assert len(sequence.block_table) == 2 and sched.allocator.num_free == 14
    assert sequence.output_tokens == [7, *drafts[:accepted], 50]


def test_a_verify_step_stops_at_an_accepted_drafts_stop_id():
    sched = started(request("a", 3, num_tokens_to_generate=20))
    step = _verify_step(sched, [30, EOS, 32])
    sequence = sched.running[0]
    (out,) = sched.update_from_output(step, [Emitted([30, EOS, 32, 33], [None] * 4, [None] * 4, [None] * 4, 3)])
    assert out.finished and out.stop_token and out.new_tokens == [30, EOS] and sequence.output_tokens == [7, 30, EOS]
    assert sched.allocator.num_free == sched.allocator.num_blocks


def first_step_of_two_long_prompts_and_a_short_one(threshold: int) -> dict[str, int]:
    """What a 16-token step with the long-prefill ``threshold`` computes of prompts of 40, 30 and 3 tokens."""
    sched = scheduler(budget=16, threshold=threshold)
    for name, length in (("long", 40), ("other", 30), ("short", 3)):
        sched.add_request(request(name, length))
    return play(sched)[0]


def test_a_long_prompt_shares_its_steps_above_the_threshold():
    # one long prompt gets its chunk of 8 in the fair pass, the short one its prompt, the rest goes to the first
    assert first_step_of_two_long_prompts_and_a_short_one(8) == {"long": 13, "short": 3}


def test_control_without_the_threshold_the_first_long_prompt_takes_the_budget():
    assert first_step_of_two_long_prompts_and_a_short_one(0) == {"long": 16}


def test_take_unfinished_hands_requests_back_with_their_tokens_and_frees_everything():
    sched = started(request("a", 5), request("b", 5), num_blocks=16)
    sched.add_request(request("", []))  # a failed admission of a request handed back is dropped with it...
    taken = sched.take_unfinished()
    assert [s.request_id for s in taken] == ["a", "b"]
    assert all(s.status is RequestStatus.WAITING_IN_QUEUE and s.output_tokens == [7] for s in taken)
    assert sched.requests == {} and not sched.has_work() and sched.allocator.num_free == 16
    assert [out.request_id for out in sched.take_pending()] == [""]  # ...only if it was handed back


def test_a_sequence_without_admission_is_queued_directly():
    """The queue-level ``add`` (the scheduler's own tests and the adapter queue use it) needs no admission."""
    sched = Scheduler(BlockAllocator(8), BLOCK, 16, 4)
    sequence = Sequence.of(request("a", 5), 10, frozenset())
    sched.add(sequence)
    assert sched.schedule().entries == [(sequence, 5)]
    with pytest.raises(AssertionError, match="without admission"):
        sched.add_request(request("b", 5))
