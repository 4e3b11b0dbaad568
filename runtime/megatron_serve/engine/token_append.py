"""A finished step's tokens appended to one request, and the stop checks each token passes: stop ids, the grammar's
end or error, the length limit. Pure bookkeeping over the request's :class:`~.sequence.Sequence`, called by
:meth:`.scheduler.Scheduler.update_from_output`; a row of a verify step brings several tokens (its accepted drafts and
one more), appended one by one as the plain engine would append them over as many steps.

A stop id (EOS, or one of ``stop_token_ids``) is kept as the last token, counted and given its log prob, as vLLM's
and SGLang's outputs keep it: an RL trainer's next turn extends prompt + completion ids exactly (a chat template
renders the assistant's end token after its turn). Its KV is never computed (the request ends there), and its
output says it is a stop token (``StepOutput.stop_token``) so that the text is made without it."""

from __future__ import annotations

import numpy as np

from ..wire.request import EventType, FinishReason
from .sequence import Sequence
from .steps import Emitted, StepOutput
from .sampling.structured_output import StructuredOutputs


def append_token(sequence: Sequence, token: int, log_prob: float | None, top_ids: list[int] | None,
                 top_log_probs: list[float] | None, epochs: tuple[int, int], structured: StructuredOutputs | None,
                 kept_ids: list[int] | None = None) -> StepOutput:
    """Append one sampled token (``epochs``: the weights' and its KV's), and say whether the request finished (a stop
    id, the grammar's end, the length limit; vLLM's ``check_stop`` order); the request's status and events are set
    here, its resources freed by the caller."""
    out = StepOutput(sequence.request_id, [], [], False, (epochs[0], epochs[1], sequence.lora_version))
    if not sequence.num_output:  # its first token: what its admission found goes with it
        sequence.add_event(EventType.FIRST_TOKEN)
        out.cached_tokens = sequence.cached_tokens
        out.prompt_scores, sequence.prompt_scores = sequence.prompt_scores, None
    finish: FinishReason | None = None
    problem: str | None = None
    sequence.token_ids.append(token)
    sequence.num_output += 1
    out.new_tokens.append(token)
    if log_prob is not None:
        out.new_log_probs.append(log_prob)
    if top_ids is not None and top_log_probs is not None:
        out.top_ids, out.top_log_probs = [top_ids], [top_log_probs]
    if kept_ids is not None:
        out.top_p_token_ids = [kept_ids]
    if token in sequence.stop_token_ids:  # the grammar allowed it only where it may end: no need to feed it
        finish = FinishReason.STOP
        out.stop_token = True
    else:
        grammar_done, problem = (structured.accept(sequence.request_id, token)
                                 if structured is not None and sequence.request_id in structured else (False, None))
        if problem is not None:
            finish = FinishReason.ERROR
        elif grammar_done:
            finish = FinishReason.STOP
        elif len(sequence.token_ids) >= sequence.max_total_tokens:
            finish = FinishReason.LENGTH
    out.new_routing = sequence.routing.take_undelivered() if sequence.routing is not None else None
    if finish is FinishReason.ERROR:
        sequence.fail(problem or "failed")
    elif finish is not None:
        sequence.complete(finish)
    if finish is not None:
        out.finished = True
        out.final = sequence.final_record()
    return out


def ended(sequence: Sequence) -> StepOutput:
    """The output of a request that ends without a token here (refused at admission, its images failed)."""
    out = StepOutput(sequence.request_id, [], [], True, final=sequence.final_record())
    if not sequence.num_output:
        out.cached_tokens = sequence.cached_tokens
        out.prompt_scores, sequence.prompt_scores = sequence.prompt_scores, None
    return out


def append_tokens(sequence: Sequence, emitted: Emitted, epochs: tuple[int, int], structured: StructuredOutputs | None,
                  draft_routing: np.ndarray | None = None) -> StepOutput:
    """Append a row's tokens one by one (several after accepted drafts), up to the one that finishes it.
    ``draft_routing``: the expert ids of the row's drafts' positions; each is recorded before the token its
    accepted draft produced, as the plain engine records a position before the token it samples there."""
    if len(emitted.tokens) == 1:  # no draft accepted (and every plain step's row)
        return append_token(sequence, emitted.tokens[0], emitted.log_probs[0], emitted.top_ids[0],
                            emitted.top_log_probs[0], epochs, structured,
                            emitted.kept_ids[0] if emitted.kept_ids else None)
    merged: StepOutput | None = None
    first = len(sequence.token_ids)  # the first draft's position (the drafts were rolled back)
    for index, (token, log_prob, top_ids, top_log_probs) in enumerate(zip(emitted.tokens, emitted.log_probs,
                                                                          emitted.top_ids, emitted.top_log_probs)):
        if index and draft_routing is not None and sequence.routing is not None:
            sequence.routing.record(first + index - 1, draft_routing[index - 1 : index])
        kept_ids = emitted.kept_ids[index] if emitted.kept_ids else None
        out = append_token(sequence, token, log_prob, top_ids, top_log_probs, epochs, structured, kept_ids)
        if merged is None:
            merged = out
        else:
            merged.extend(out)
        if out.finished:
            break
    assert merged is not None, "a sampled row emits at least one token"
    return merged
