"""What an engine step sends about each request: its new token ids and what was asked to go with them.

The step thread builds one struct per request here and nothing else: no text, no stop strings
(:mod:`megatron_serve.client.output_processor` makes those where the tokens are read), and the final
record leaves out what the deltas already carried. The engine process sends a step's structs as
one message (``ENGINE_STEP``), or several when prompt scores make it large (:func:`step_bodies`), with the
final records of the requests that finished beside the deltas, never inside them: the coordinator forwards
both as these bytes (a delta to the client's ``STEP_TOKENS``, a record in ``RESULT``). The in-process client
hands the same structs to its event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..wire.expert_routing import routing_to_wire
from ..wire.deltas import EngineStepOut, RequestDelta, RoutingRows
from ..wire.request import FinalRecord

if TYPE_CHECKING:
    from .steps import StepOutput


#: Prompt-score entries (a log prob, or an alternative's id and log prob) and kept ids (``return_top_p_token_ids``:
#: up to the vocabulary per token) one ``ENGINE_STEP`` message carries at most beside its other deltas, about 3 MB: a
#: request's prompt scores all go with its first token, and several requests that finish their prefill in one step
#: (or keep most of a large vocabulary) could together pass the 16 MiB frame, which is then not sent at all (every
#: delta of the step lost). One request's prompt scores stay within the frame by the request budget
#: (``--max-request-logprobs``).
STEP_MESSAGE_SCORES = 1 << 18


def _scores(delta: RequestDelta) -> int:
    kept = sum(map(len, delta.top_p_token_ids)) if delta.top_p_token_ids is not None else 0
    scores = delta.prompt_scores
    if scores is None:
        return kept
    return kept + len(scores.log_probs) + sum(map(len, scores.top_ids or ()))


def step_messages(deltas: list[RequestDelta], limit: int = STEP_MESSAGE_SCORES) -> list[list[RequestDelta]]:
    """A step's deltas as the ``ENGINE_STEP`` messages that carry them, in order: one, unless prompt scores and kept
    ids pass ``limit`` entries, then cut before the delta that would pass it."""
    if all(delta.prompt_scores is None and delta.top_p_token_ids is None for delta in deltas):
        return [deltas]
    messages: list[list[RequestDelta]] = [[]]
    held = 0
    for delta in deltas:
        weight = _scores(delta)
        if messages[-1] and held + weight > limit:
            messages.append([])
            held = 0
        messages[-1].append(delta)
        held += weight
    return messages


def step_delta(out: "StepOutput") -> RequestDelta:
    """One request's share of a step as it travels: the output's own fields (nothing the engine changes later)."""
    tokens = out.new_tokens
    delta = RequestDelta(request_id=out.request_id, new_tokens=tokens, finished=out.finished)
    if out.new_log_probs:
        delta.new_log_probs = out.new_log_probs
    if out.top_ids:
        delta.top_ids, delta.top_log_probs = out.top_ids, out.top_log_probs
    if out.top_p_token_ids:
        delta.top_p_token_ids = out.top_p_token_ids
    n = len(tokens)
    if n:
        policy, kv, lora = out.epochs
        delta.epochs = [[policy] * n, [kv] * n, [lora] * n]
    if out.new_routing is not None:
        start, rows = out.new_routing
        delta.routing = RoutingRows(start=start, **routing_to_wire(rows))
    if out.cached_tokens is not None:
        delta.cached_tokens = out.cached_tokens
        delta.prompt_scores = out.prompt_scores
    if out.stop_token:
        delta.stop_token = True
    return delta


def step_bodies(engine_id: str, outputs: Sequence["StepOutput"]) -> list[EngineStepOut]:
    """A step's ``ENGINE_STEP`` bodies (:func:`step_messages`): each request's delta, and the final records of those
    that finished in the body of their delta."""
    finals = {out.request_id: out.final for out in outputs if out.finished}
    return [EngineStepOut(engine_id=engine_id, outputs=deltas,
                          records={d.request_id: finals[d.request_id] for d in deltas if d.finished})
            for deltas in step_messages([step_delta(out) for out in outputs])]


def ended_body(engine_id: str, records: list[FinalRecord]) -> EngineStepOut:
    """The ``ENGINE_STEP`` of requests that end without a step's tokens (a failed step, an unreadable request): each
    an empty finished delta beside its record."""
    return EngineStepOut(engine_id=engine_id, records={r.request_id: r for r in records},
                         outputs=[RequestDelta(request_id=r.request_id, new_tokens=[], finished=True) for r in records])
