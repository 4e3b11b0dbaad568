"""What changes a step's logits before sampling: logit bias, min_tokens, penalties, and grammar masks.

Every control is batched: one handful of device ops per step covers all the rows that use it,
and rows that use none are not touched. A step in which no row uses any control gets its logits
back as they are (no copy), so greedy output with neutral controls is bit-for-bit unchanged.

The order is vLLM's: logit bias and min_tokens first, then the penalties (repetition on prompt and
output tokens, frequency and presence on output tokens, as the OpenAI API defines them), then the
grammar's token mask last, so that nothing can make a token the grammar forbids possible again.
Temperature, min-p, top-k and top-p follow in the sampler.

The penalties rebuild each row's token counts from its token lists every step (one host-to-device
copy of the ids of the penalised rows only). That is O(tokens) host work per penalised row and
step; keeping counts on the device between steps is the next step if long penalised generations
show up in profiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from ..wire.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class RowContext:
    """What the controls of one sampling row look at."""

    params: SamplingParams
    prompt_tokens: Seq[int]
    output_tokens: Seq[int]  # read by the penalties only (their rows never have a token in flight)
    stop_token_ids: frozenset[int]  # what min_tokens holds back
    num_output: int  # tokens generated so far, those in flight included


def _flat_index(rows: list[int], lists: list[Seq[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row index per entry, entry)`` of ragged integer lists, as two device tensors."""
    lengths = torch.tensor([len(values) for values in lists], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    values = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    return row_ids.to(device, non_blocking=True), values.to(device, non_blocking=True)


def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[RowContext]) -> None:
    vocab = logits.shape[-1]
    bias_rows, bias_ids, bias_values = [], [], []
    blocked_rows, blocked_ids = [], []
    for i, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            if token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(bias)
        if row.num_output < row.params.min_tokens:
            blocked = [t for t in row.stop_token_ids if t < vocab]
            blocked_rows.extend([i] * len(blocked))
            blocked_ids.extend(blocked)
    device = logits.device
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        logits.index_put_(index, torch.tensor(bias_values, dtype=logits.dtype, device=device), accumulate=True)
    if blocked_rows:
        logits[torch.tensor(blocked_rows, device=device), torch.tensor(blocked_ids, device=device)] = NEG_INF


def _apply_penalties(logits: torch.Tensor, rows: list[RowContext]) -> None:
    penalised = [i for i, row in enumerate(rows) if row.params.presence_penalty or row.params.frequency_penalty
                 or row.params.repetition_penalty != 1.0]
    if not penalised:
        return
    device, vocab = logits.device, logits.shape[-1]
    count = len(penalised)
    local = list(range(count))
    outputs = [[t for t in rows[i].output_tokens if t < vocab] for i in penalised]
    counts = torch.zeros((count, vocab), dtype=logits.dtype, device=device)
    row_ids, token_ids = _flat_index(local, outputs, device)
    counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=logits.dtype), accumulate=True)
    values = logits[penalised]
    repetition = [rows[i].params.repetition_penalty for i in penalised]
    if any(r != 1.0 for r in repetition):
        seen = counts > 0
        prompts = [[t for t in rows[i].prompt_tokens if t < vocab] for i in penalised]
        prompt_rows, prompt_ids = _flat_index(local, prompts, device)
        seen[prompt_rows, prompt_ids] = True
        factor = torch.tensor(repetition, dtype=logits.dtype, device=device)[:, None].expand_as(values)
        scaled = torch.where(values > 0, values / factor, values * factor)
        values = torch.where(seen, scaled, values)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in penalised], dtype=logits.dtype, device=device)
    presence = torch.tensor([rows[i].params.presence_penalty for i in penalised], dtype=logits.dtype, device=device)
    values = values - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    logits[penalised] = values


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, ceil(vocab/32)]`` int32 words (bit ``t % 32`` of word ``t // 32`` = token t allowed) to bools."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still reads right
    return bits.flatten(1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Forbid (set to -inf) every token that ``bitmask`` does not allow, in ``logits[rows]``, in place.

    ``bitmask`` lives on the host (the grammar engine writes it there); it is copied to the
    logits' device once per step for all constrained rows together.
    """
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, NEG_INF)


def apply_controls(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """Logit bias, min_tokens and penalties applied: a new tensor when a row uses any, else ``logits`` itself."""
    if not any(row.params.has_logits_controls for row in rows):
        return logits
    logits = logits.clone()
    _apply_bias_and_min_tokens(logits, rows)
    _apply_penalties(logits, rows)
    return logits
