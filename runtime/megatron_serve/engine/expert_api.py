"""Megatron's expert API over an engine of ids in, deltas out: the one place the engine meets the public record.

Megatron-core's users drive the engine themselves: ``engine.add_request(DynamicInferenceRequest(...))``, then
``engine.step()`` until ``has_unfinished_requests()`` is False, reading the requests they added (and each step
output's ``request``); ``abort_request`` and ``take_unfinished_requests`` hand the public requests back
(``MegatronLLM.engine`` is such an engine). Inside, a request is its :class:`~.sequence.Sequence`, built from an
``EngineRequest``, and a step makes outputs (:class:`~.steps.StepOutput`: new tokens and what goes with them, the
final record once done, and the caller's record of the request, a type parameter that this module fills with the
public request, so that the steps name no public type). :class:`ExpertApi` turns each public request added into the
``EngineRequest`` the engine takes, and applies each output of such a request to it as the output is made (a step's
tokens are on the request once the step is read, as an engine process sends them then), the final record's status,
events and times included: the request ends up as a client's collector would complete it, text aside (the engine
makes none).

Requests that come as ``EngineRequest`` (an engine process, the in-process client) pass through untouched, and
while no public request is in the engine nothing here runs but one check per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..wire.expert_routing import RoutingRecord
from ..wire.request import DynamicInferenceRequest, EngineRequest, FinalRecord, RoutingArray
from ..wire.submission import WireImage
from .sequence import Sequence
from .steps import StepOutput

#: The public record of a request, as Megatron's expert API adds it and reads it.
Public = DynamicInferenceRequest
#: What the engine's ``add_request`` takes: an ``EngineRequest``, or a public request (the expert API).
Submitted = EngineRequest | Public
#: What its ``abort_request`` and ``take_unfinished_requests`` give: the public request for one added so, else the
#: final record.
Ended = FinalRecord | Public


@dataclass
class _Added:
    """A public request in the engine, and its expert rows so far (``return_routing_indices``)."""

    request: DynamicInferenceRequest
    routing: RoutingRecord | None = None

    def record_rows(self, start: int, rows: np.ndarray) -> None:
        if self.routing is None:
            self.routing = RoutingRecord(rows.shape[1], rows.shape[2], rows.dtype)
        self.routing.record(start, rows)


class ExpertApi:
    """The public requests added to one engine, until they leave it (see the module docstring)."""

    def __init__(self) -> None:
        self._added: dict[str, _Added] = {}

    def add(self, request: Submitted, add: Callable[[EngineRequest], None]) -> None:
        """Hand ``request`` to the engine's ``add``; a public request is registered first, so that a refusal (made
        during ``add``) is applied to it, even when a request of its id is in the engine already."""
        if isinstance(request, EngineRequest):
            add(request)
            return
        request_id = request.request_id
        earlier = self._added.get(request_id)
        self._added[request_id] = _Added(request, _routing_of(request))
        n = len(request.generated_tokens)
        for epochs in (request.policy_epochs, request.kv_epochs, request.lora_epochs):
            epochs[:0] = [-1] * max(n - len(epochs), 0)  # a continuation whose epochs were not kept: unknown
        add(EngineRequest(
            request_id=request_id, prompt_tokens=request.prompt_tokens, sampling_params=request.sampling_params,
            generated_tokens=request.generated_tokens, events=list(request.events),
            arrival_time=request.arrival_time,
            images=[WireImage(data=i.data, offset=i.offset, length=i.length) for i in request.images],
            routing_indices=None if request.routing_indices is None else RoutingArray.of(request.routing_indices)))
        if earlier is not None:  # a second request of a live id: refused alone above, the first one goes on
            self._added[request_id] = earlier

    def apply(self, outputs: list[StepOutput[Public]]) -> None:
        """Apply each output of a public request to it, as the output is made (the scheduler's ``emitted``)."""
        added = self._added
        if not added:
            return
        for out in outputs:
            entry = added.get(out.request_id)
            if entry is None:
                continue
            request = out.request = entry.request
            tokens = out.new_tokens
            if len(tokens) == 1:  # a plain step's token (appended one by one: this runs for every token)
                request.generated_tokens.append(tokens[0])
                policy, kv, lora = out.epochs
                request.policy_epochs.append(policy)
                request.kv_epochs.append(kv)
                request.lora_epochs.append(lora)
                if out.new_log_probs:
                    request.generated_log_probs.append(out.new_log_probs[0])
                if out.top_ids is not None and out.top_log_probs is not None:
                    request.generated_top_n_logprobs.append(dict(zip(out.top_ids[0], out.top_log_probs[0])))
                if out.top_p_token_ids is not None:
                    request.generated_top_p_token_ids.append(out.top_p_token_ids[0])
            elif tokens:
                _extend(request, out)
            if out.cached_tokens is not None:
                request.cached_tokens = out.cached_tokens
            scores = out.prompt_scores
            if scores is not None:
                request.prompt_log_probs = list(scores.log_probs)
                request.prompt_ranks = list(scores.ranks or ())
                if scores.top_ids is not None and scores.top_log_probs is not None:
                    request.prompt_top_n_logprobs = list(map(dict, map(zip, scores.top_ids, scores.top_log_probs)))
            if out.new_routing is not None:
                entry.record_rows(*out.new_routing)
            if out.final is not None:
                del added[out.request_id]
                _end(entry, out.final)

    def ended(self, sequence: Sequence) -> Ended:
        """How a request that left without a final output (aborted, handed back) ended: the public request for one
        added so (with the expert rows not delivered yet), else its final record."""
        final = sequence.final_record()
        entry = self._added.pop(sequence.request_id, None)
        if entry is None:
            return final
        undelivered = sequence.routing.take_undelivered() if sequence.routing is not None else None
        if undelivered is not None:
            entry.record_rows(*undelivered)
        return _end(entry, final)


def _extend(request: DynamicInferenceRequest, out: StepOutput[Public]) -> None:
    """Append an output's several tokens (a verify step's accepted drafts and one more) and what goes with them."""
    n = len(out.new_tokens)
    request.generated_tokens += out.new_tokens
    policy, kv, lora = out.epochs
    request.policy_epochs += [policy] * n
    request.kv_epochs += [kv] * n
    request.lora_epochs += [lora] * n
    request.generated_log_probs += out.new_log_probs
    if out.top_ids is not None and out.top_log_probs is not None:
        request.generated_top_n_logprobs += map(dict, map(zip, out.top_ids, out.top_log_probs))
    if out.top_p_token_ids is not None:
        request.generated_top_p_token_ids += out.top_p_token_ids


def _routing_of(request: DynamicInferenceRequest) -> RoutingRecord | None:
    """Where a public request asking for its expert rows keeps them, from those it brings (a continuation)."""
    if not request.sampling_params.return_routing_indices:
        return None
    rows = request.routing_indices
    if rows is None or rows.ndim != 3 or not len(rows):
        return None  # made with the first rows delivered (their shape is the model's)
    return RoutingRecord(rows.shape[1], rows.shape[2], rows.dtype, rows)


def _end(entry: _Added, final: FinalRecord) -> DynamicInferenceRequest:
    """The public request, with what the engine's final record says of how it went."""
    request = entry.request
    request.status = final.status
    request.finish_reason = final.finish_reason
    request.error = final.error
    request.events = list(final.events)
    request.cached_tokens = final.cached_tokens
    if final.first_token_time is not None:  # a continuation's first token came before this engine
        request.first_token_time = final.first_token_time
    request.finish_time = final.finish_time
    if entry.routing is not None:
        request.routing_indices = entry.routing.array()
    return request
