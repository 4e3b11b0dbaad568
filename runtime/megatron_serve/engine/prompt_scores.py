"""Prompt log probs: the positions a step scores (``step_plan``'s score rows), scored on the device, and
their values recorded on the requests when the step is finished."""

from __future__ import annotations

from typing import Callable

import torch

from ..wire.request import DynamicInferenceRequest
from .sampler import DeviceScores, score_tokens
from .sequence import Sequence
from .step_plan import prompt_positions_to_score


def score_prompts(entries: list[tuple[Sequence, int]], logits: torch.Tensor,
                  view: Callable[[DynamicInferenceRequest, torch.Tensor], torch.Tensor] | None = None
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
            pieces.append(view(sequence.request, logits[row : row + len(positions)]))
            row += len(positions)
        logits = torch.cat(pieces)
    targets = torch.tensor([s.token_ids[p + 1] for s, positions in spans for p in positions], dtype=torch.int64)
    if logits.device.type == "cuda":
        targets = targets.pin_memory().to(logits.device, non_blocking=True)
    top_n = max(s.request.sampling_params.top_n_logprobs for s, _ in spans)
    return spans, score_tokens(logits, targets, top_n)


def record_prompt_scores(spans: list[tuple[Sequence, range]], device_scores: DeviceScores) -> None:
    """Append a finished step's prompt scores to their requests (waits for the device)."""
    scores = device_scores.read()
    row = 0
    for sequence, positions in spans:
        request = sequence.request
        request.prompt_log_probs.extend(scores.log_probs[row : row + len(positions)])
        n = request.sampling_params.top_n_logprobs
        if n:
            request.prompt_top_n_logprobs.extend(dict(zip(scores.top_ids[i][:n], scores.top_log_probs[i][:n]))
                                                 for i in range(row, row + len(positions)))
        row += len(positions)
