"""Trainer batches as RL trainers build them from finished rollouts: right-padded, left-padded and packed.

Each builder takes the sequences (prompt + completion token ids) and returns the model's keyword arguments
and, per sequence, where its tokens sit in the flattened ``[batch * length]`` logits; :func:`completion_log_probs`
reads each sequence's completion log probs back, as a trainer's loss does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .runs import TargetRun

PAD = 0


@dataclass
class Batch:
    kwargs: dict[str, torch.Tensor | int]
    places: list[torch.Tensor]  # per sequence: its tokens' flat indices, in order


def right_padded(sequences: list[list[int]], length: int) -> Batch:
    ids = torch.full((len(sequences), length), PAD)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
    return Batch({"input_ids": ids, "attention_mask": mask},
                 [row * length + torch.arange(len(s)) for row, s in enumerate(sequences)])


def left_padded(sequences: list[list[int]], length: int) -> Batch:
    """verl's layout: padding first, ``position_ids = (mask.cumsum(-1) - 1).clamp_min(0)``."""
    ids = torch.full((len(sequences), length), PAD)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, length - len(sequence):] = torch.tensor(sequence)
        mask[row, length - len(sequence):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": positions},
                 [row * length + torch.arange(length - len(s), length) for row, s in enumerate(sequences)])


def _packed_row(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
    offsets = [0]
    for sequence in sequences:
        offsets.append(offsets[-1] + len(sequence))
    ids = torch.tensor([token for sequence in sequences for token in sequence])[None]
    positions = torch.cat([torch.arange(len(sequence)) for sequence in sequences])[None]
    return ids, positions, offsets, [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]


def packed(sequences: list[list[int]]) -> Batch:
    """One row, ``position_ids`` restarting at 0 per sequence (``transformers``' padding-free collator)."""
    ids, positions, _, places = _packed_row(sequences)
    return Batch({"input_ids": ids, "position_ids": positions}, places)


def packed_varlen(sequences: list[list[int]]) -> Batch:
    """One row with flash-attention's varlen arguments: ``cu_seq_lens`` and the longest length."""
    ids, positions, offsets, places = _packed_row(sequences)
    cu = torch.tensor(offsets, dtype=torch.int32)
    longest = max(map(len, sequences))
    return Batch({"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                  "max_length_q": longest, "max_length_k": longest}, places)


LAYOUTS: dict[str, Callable[[list[list[int]]], Batch]] = {
    "right-padded to 64": lambda s: right_padded(s, 64),
    "left-padded to 96": lambda s: left_padded(s, 96),
    "packed": packed,
    "packed, cu_seq_lens": packed_varlen,
}


def completion_log_probs(logits: torch.Tensor, batch: Batch, runs: list[TargetRun]) -> list[list[float]]:
    """Each run's completion tokens' log probs from the batch's logits (``log_softmax(logits.float())`` at
    the token before each)."""
    flat = torch.log_softmax(logits.float(), -1).reshape(-1, logits.shape[-1])
    out = []
    for place, run in zip(batch.places, runs):
        rows = place[len(run.prompt) - 1:-1]
        out.append(flat[rows, torch.tensor(run.tokens)].tolist())
    return out
