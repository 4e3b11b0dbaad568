"""What changes a step's logits before sampling: logit bias, min_tokens, penalties, and grammar masks.

Every control is batched: one handful of device ops per step covers all the rows that use it,
and rows that use none are not touched. A step in which no row uses any control gets its logits
back as they are (no copy), so greedy output with neutral controls is bit-for-bit unchanged.

The order is vLLM's: logit bias and min_tokens first, then the penalties (repetition on prompt and
output tokens, frequency and presence on output tokens, as the OpenAI API defines them), then the
grammar's token mask last, so that nothing can make a token the grammar forbids possible again.
Temperature, min-p, top-k and top-p follow in the sampler.

Every control reads its per-request values from the :class:`~.sampling_state.SamplingState`
tables on the device; the penalties' output token counts are kept there too (updated by the sampler
with each token drawn), so a penalised request needs no token on the host and no step builds a
tensor from Python data.
"""

from __future__ import annotations

import torch

from .sampling_state import SamplingState, StepRows

NEG_INF = float("-inf")


def apply_controls(logits: torch.Tensor, state: SamplingState, rows: StepRows,
                   extra_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logit bias, min_tokens and penalties applied: a new tensor when a row uses any, else ``logits`` itself.
    ``extra_counts`` ``[rows, vocab]``: tokens each row's penalties count beyond its request's output on the
    device (a verify step's drafts before the row's depth).

    Every row of the step goes through the same ops (rows without controls read the neutral control
    row, which leaves their logits bitwise unchanged: ``x + 0``, ``x - 0 * count``); the tables are read
    on the device, nothing is built from Python data.
    """
    if not rows.any_controls:
        return logits
    control = rows.control
    logits = logits + state.bias[control]
    if rows.uses("min_tokens"):
        held = state.stop_mask[control] & (rows.generated < state.vector("min_tokens")[rows.slot])[:, None]
        logits = logits.masked_fill(held, NEG_INF)
    if rows.any_penalties:
        counts = state.counts[control] if extra_counts is None else state.counts[control] + extra_counts
        if rows.uses("repetition"):
            factor = state.vector("repetition")[rows.slot][:, None]
            seen = (counts > 0) | state.prompt_mask[control]
            logits = torch.where(seen, torch.where(logits > 0, logits / factor, logits * factor), logits)
        frequency = state.vector("frequency")[rows.slot][:, None]
        presence = state.vector("presence")[rows.slot][:, None]
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, ceil(vocab/32)]`` int32 words (bit ``t % 32`` of word ``t // 32`` = token t allowed) to bools."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still reads right
    return bits.flatten(1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token that ``bitmask`` (one row per logits row) does not allow set to -inf.

    ``bitmask`` lives on the host (the grammar engine writes it there; unconstrained rows allow
    everything); it is copied to the logits' device once per step for all rows together.
    """
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.masked_fill(~allowed, NEG_INF)
