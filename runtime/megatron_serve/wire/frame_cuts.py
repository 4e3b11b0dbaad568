"""Where token messages heavy with per-token entries are cut so that each fits the frame: one rule for an engine
step's ``ENGINE_STEP`` (cut between its requests' deltas) and a reconnected or resubmitting client's catch-up (one
request's delta cut between its tokens, each piece a ``STEP_TOKENS`` of its own).

A delta's size is set by what no per-token bound keeps small: a request's prompt scores, which all travel with its
first token, and its kept ids (``return_top_p_token_ids``: up to the vocabulary per token), with the top-n
alternatives counted beside them. A step carries one token per request, but a catch-up carries every token the
client missed: a few hundred tokens of large kept sets pass the 16 MiB frame, which is then not sent at all.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from .deltas import TokenDelta

#: Entries (a log prob or an alternative of the prompt scores, a kept id, a top-n alternative) one message carries at
#: most, about 3 MB: well within the 16 MiB frame whatever else the message holds. One request's prompt scores travel
#: whole with its first token; the request budget (``--max-request-logprobs``) keeps them within the frame.
FRAME_ENTRIES = 1 << 18

_Values = TypeVar("_Values")


def _prompt_entries(delta: TokenDelta) -> int:
    scores = delta.prompt_scores
    return 0 if scores is None else len(scores.log_probs) + sum(map(len, scores.top_ids or ()))


def delta_entries(delta: TokenDelta) -> int:
    """The entries ``delta`` carries (its prompt scores, kept ids and top-n alternatives)."""
    kept = sum(map(len, delta.top_p_token_ids)) if delta.top_p_token_ids is not None else 0
    return _prompt_entries(delta) + kept + (sum(map(len, delta.top_ids)) if delta.top_ids is not None else 0)


def token_entries(delta: TokenDelta) -> list[int]:
    """The entries each of ``delta``'s tokens brings (the prompt scores go with its first). Per-token lists may cover
    only the last tokens (a resubmission's own tokens came without them): they end with the tokens."""
    count = len(delta.new_tokens)
    weights = [0] * count
    for values in (delta.top_p_token_ids, delta.top_ids):
        for i, entries in enumerate(values or (), start=count - len(values or ())):
            weights[i] += len(entries)
    if count:
        weights[0] += _prompt_entries(delta)
    return weights


def runs(weights: list[int], limit: int = FRAME_ENTRIES) -> list[range]:
    """Consecutive runs of items of these ``weights`` covering them all, in order, each within ``limit`` in all: a run
    ends before the item that would pass it (an item past ``limit`` by itself is a run of its own: it is not cut)."""
    cuts: list[range] = []
    start = held = 0
    for i, weight in enumerate(weights):
        if i > start and held + weight > limit:
            cuts.append(range(start, i))
            start, held = i, 0
        held += weight
    if start < len(weights):
        cuts.append(range(start, len(weights)))
    return cuts


def _cut(values: list[_Values] | None, count: int, run: range) -> list[_Values] | None:
    """The part of per-token ``values`` (ending with ``count`` tokens) for the tokens of ``run``; None when empty."""
    if values is None:
        return None
    lead = count - len(values)  # tokens before the first that has a value
    return values[max(run.start - lead, 0):max(run.stop - lead, 0)] or None


def delta_pieces(delta: TokenDelta, limit: int = FRAME_ENTRIES) -> list[tuple[int, TokenDelta]]:
    """``delta`` cut between its tokens into pieces of at most ``limit`` entries (:func:`runs`), each with the index
    of its first token in ``delta``: the first piece brings the prompt scores and cached tokens, the last the routing
    rows and the stop mark, so a client that already has a piece's tokens loses nothing by dropping it. One piece,
    ``delta`` itself, when it fits."""
    count = len(delta.new_tokens)
    weights = token_entries(delta)
    if sum(weights) <= limit:
        return [(0, delta)]
    pieces = []
    for run in runs(weights, limit):
        first, last = run.start == 0, run.stop == count
        epochs = None if delta.epochs is None else [_cut(e, count, run) or [] for e in delta.epochs]
        pieces.append((run.start, msgspec.structs.replace(
            delta, new_tokens=delta.new_tokens[run.start:run.stop], new_log_probs=_cut(delta.new_log_probs, count, run),
            top_ids=_cut(delta.top_ids, count, run), top_log_probs=_cut(delta.top_log_probs, count, run),
            top_p_token_ids=_cut(delta.top_p_token_ids, count, run), epochs=epochs,
            cached_tokens=delta.cached_tokens if first else None, prompt_scores=delta.prompt_scores if first else None,
            routing=delta.routing if last else None, stop_token=delta.stop_token and last)))
    return pieces
