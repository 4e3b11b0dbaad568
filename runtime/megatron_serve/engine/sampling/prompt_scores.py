"""Prompt log probs: the positions a step scores (``step_plan``'s score rows), scored on the device, and
their values kept on the sequences when the step is finished, in the wire's form, until the request's first
output carries them (:mod:`.token_append`)."""

from __future__ import annotations

from typing import Callable

import torch

from ...wire.deltas import PromptScores
from .sampler import DeviceScores, score_tokens
from ..sequence import Sequence
from ..step_plan import prompt_positions_to_score


def score_prompts(entries: list[tuple[Sequence, int]], logits: torch.Tensor,
                  view: Callable[[Sequence, torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[list[tuple[Sequence, range]], DeviceScores] | None:
    """Prompt log probs (and top-n) of the positions this step scores, on the device (``step_plan``'s order).
    ``view``: what each request's rows are scored as (the log-prob check's in a processed mode), else as they are.

    The targets (the next prompt tokens) go to the device from pinned memory without blocking: a copy from
    pageable memory would wait for the forward queued before it.
    """
    if not logits.shape[0]:
        return None
    spans = [(s, positions) for s, count in entries if (positions := prompt_positions_to_score(s, count))]
    if view is not None:
        pieces, row = [], 0
        for sequence, positions in spans:
            pieces.append(view(sequence, logits[row : row + len(positions)]))
            row += len(positions)
        logits = torch.cat(pieces)
    targets = torch.tensor([s.token_ids[p + 1] for s, positions in spans for p in positions], dtype=torch.int64)
    if logits.device.type == "cuda":
        targets = targets.pin_memory().to(logits.device, non_blocking=True)
    top_n = max(s.sampling_params.top_n_logprobs for s, _ in spans)
    return spans, score_tokens(logits, targets, top_n, ranked=True)


def record_prompt_scores(spans: list[tuple[Sequence, range]], device_scores: DeviceScores) -> None:
    """Keep a finished step's prompt scores on their sequences (waits for the device)."""
    scores = device_scores.read()
    row = 0
    for sequence, positions in spans:
        end = row + len(positions)
        n = sequence.sampling_params.top_n_logprobs
        kept = sequence.prompt_scores
        if kept is None:
            sequence.prompt_scores = kept = PromptScores(log_probs=[], top_ids=[] if n else None,
                                                          top_log_probs=[] if n else None, ranks=[])
        kept.log_probs += scores.log_probs[row:end]
        if kept.ranks is not None and scores.ranks is not None:
            kept.ranks += scores.ranks[row:end]
        if n:
            kept.top_ids += [ids[:n] for ids in scores.top_ids[row:end]]
            kept.top_log_probs += [values[:n] for values in scores.top_log_probs[row:end]]
        sequence.num_scored += len(positions)
        row = end
