"""Megatron's expert API through its one adapter (``engine.expert_api``), over the scheduler alone (no model): a
public request added becomes an ``EngineRequest``, and the outputs the scheduler makes are applied to it as they
are made; ``EngineRequest`` callers pass through untouched. The engine-level runs (tokens equal to the serving
path's) are in ``test_engine.py`` and ``test_step_paths.py``."""

from __future__ import annotations

import time

import numpy as np
import torch

from megatron_serve.engine.expert_api import ExpertApi
from megatron_serve.engine.sampling.sampler import DeviceScores, Readback
from megatron_serve.engine.steps import Emitted
from megatron_serve.wire.expert_routing import RoutingCapture
from megatron_serve.wire.request import (DynamicInferenceRequest, EngineRequest, EventType, FinalRecord, FinishReason,
                                         RequestStatus)
from megatron_serve.wire.sampling_params import SamplingParams

from .test_scheduler import launch, play, scheduler


def expert(**kwargs):
    sched = scheduler(**kwargs)
    api = ExpertApi()
    sched.emitted.append(api.apply)
    return sched, api


def public(name: str, length: int = 5, **params) -> DynamicInferenceRequest:
    params.setdefault("num_tokens_to_generate", 3)
    return DynamicInferenceRequest(name, None, [10 + i for i in range(length)], SamplingParams(**params))


def test_a_public_request_gets_each_steps_tokens_as_the_step_is_read_and_its_record_at_the_end():
    sched, api = expert()
    request = public("a", ignore_eos=True)
    api.add(request, sched.add_request)
    assert sched.requests["a"].prompt_tokens == request.prompt_tokens and request.generated_tokens == []
    _, (out,) = play(sched, 7)
    assert out.request is request and request.generated_tokens == [7] and request.generated_log_probs == [-0.5]
    assert (request.policy_epochs, request.kv_epochs, request.lora_epochs) == ([0], [0], [-1])
    assert request.status is RequestStatus.WAITING_IN_QUEUE and not request.finished  # set by the final record
    sched.epoch = 2
    play(sched, 8)
    _, (out,) = play(sched, 9)
    assert out.finished and request.generated_tokens == [7, 8, 9] and request.policy_epochs == [0, 2, 2]
    assert request.status is RequestStatus.COMPLETED and request.finish_reason is FinishReason.LENGTH
    assert [e.type for e in request.events] == [EventType.ADD, EventType.PREFILL, EventType.FIRST_TOKEN,
                                                EventType.FINISH]
    assert request.first_token_time is not None and request.latency is not None and request.latency >= 0
    api.apply([out])  # it left the adapter: an output is applied once
    assert request.generated_tokens == [7, 8, 9]


def test_an_engine_request_passes_through_untouched():
    sched, api = expert()
    added = []
    plain = EngineRequest(request_id="e", prompt_tokens=[5, 6], arrival_time=time.time())
    api.add(plain, added.append)
    assert added == [plain]
    api.add(plain, sched.add_request)
    _, (out,) = play(sched, 7)
    assert out.request is None and out.new_tokens == [7]


def test_a_refused_public_request_fails_at_once_and_a_duplicate_id_leaves_the_first_running():
    sched, api = expert(max_sequence_length=64)
    first, second, empty = public("a"), public("a"), public("empty", 0)
    for request in (first, second, empty):
        api.add(request, sched.add_request)
    assert empty.status is RequestStatus.FAILED and empty.error == "prompt is empty"
    assert second.status is RequestStatus.FAILED and "already in this engine" in second.error
    assert first.status is RequestStatus.WAITING_IN_QUEUE and first.error is None
    play(sched, 7)
    assert first.generated_tokens == [7] and second.generated_tokens == []


def test_abort_and_hand_back_return_the_public_request_else_the_final_record():
    sched, api = expert()
    request = public("a", num_tokens_to_generate=8)
    api.add(request, sched.add_request)
    api.add(EngineRequest(request_id="e", prompt_tokens=[5, 6], arrival_time=time.time()), sched.add_request)
    play(sched, 7)
    assert api.ended(sched.abort_request("a")) is request
    assert request.finish_reason is FinishReason.ABORT and request.generated_tokens == [7]
    (record,) = [api.ended(s) for s in sched.take_unfinished()]
    assert isinstance(record, FinalRecord) and record.request_id == "e"
    assert record.status is RequestStatus.WAITING_IN_QUEUE


def test_a_continuation_keeps_its_tokens_and_gets_unknown_epochs_for_those_it_brought():
    sched, api = expert()
    request = public("a", ignore_eos=True)
    request.generated_tokens = [40, 41]
    api.add(request, sched.add_request)
    assert sched.requests["a"].output_tokens == [40, 41]
    _, (out,) = play(sched, 7)
    assert out.finished and request.generated_tokens == [40, 41, 7] and request.policy_epochs == [-1, -1, 0]


def test_the_first_output_alone_carries_cached_tokens_and_prompt_scores():
    """The prompt scores are kept on the sequence until its first output carries them (then dropped), and the
    public request gets them from that output, in its form (a map per position)."""
    sched, api = expert()
    request = public("a", 4, return_prompt_log_probs=True, top_n_logprobs=2, num_tokens_to_generate=2)
    api.add(request, sched.add_request)
    sequence = sched.requests["a"]
    batch = sched.schedule()
    step = launch(sched, batch)
    values = torch.tensor([-1.0, -2.0, -3.0])
    top = [torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([[-0.25, -1.5], [-0.5, -0.75], [-1.25, -2.5]])]
    step.scores = ([(sequence, range(0, 3))], DeviceScores(Readback([values, *top]), 2))
    (first,) = sched.update_from_output(step, [Emitted([7], [-0.5], [[7, 8]], [[-0.5, -0.9]])])
    assert first.cached_tokens == 0 and first.prompt_scores.log_probs == [-1.0, -2.0, -3.0]
    assert first.prompt_scores.top_ids == [[1, 2], [3, 4], [5, 6]] and sequence.prompt_scores is None
    assert sequence.num_scored == 3 and sequence.prompt_scores_missing == 0
    assert request.prompt_log_probs == [-1.0, -2.0, -3.0] and request.prompt_top_n_logprobs[1] == {3: -0.5, 4: -0.75}
    assert request.generated_top_n_logprobs == [{7: -0.5, 8: -0.9}]
    _, (second,) = play(sched, 9)
    assert second.cached_tokens is None and second.prompt_scores is None and second.finished


def test_expert_rows_are_delivered_once_and_the_public_request_gets_them_all():
    sched, api = expert()
    request = public("a", 3, ignore_eos=True, num_tokens_to_generate=2)
    api.add(request, sched.add_request)
    sequence = sched.requests["a"]
    sequence.routing = RoutingCapture(2, 1, np.dtype(np.uint8))  # as admission makes it on a MoE model
    rows = np.arange(6, dtype=np.uint8).reshape(3, 2, 1)
    sequence.routing.record(0, rows)
    _, (first,) = play(sched, 7)
    assert first.new_routing[0] == 0 and first.new_routing[1].tolist() == rows.tolist()
    sequence.routing.record(3, rows[:1] + 10)
    _, (second,) = play(sched, 8)
    assert second.new_routing[0] == 3 and second.new_routing[1].tolist() == (rows[:1] + 10).tolist()
    assert request.routing_indices.tolist() == np.concatenate([rows, rows[:1] + 10]).tolist()
