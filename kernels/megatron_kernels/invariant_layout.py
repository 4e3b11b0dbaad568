"""Where each token of a trainer's batch belongs: the sequences of a right-padded, left-padded or packed batch.

The engine computes every request as its own sequence from position 0. A trainer hands the model a
``[batch, length]`` tensor that may hold padding on either side and several sequences per row (packing,
as verl, slime and NeMo-RL do by default): ``position_ids`` restarting at 0 for each sequence, and/or
flash-attention's ``cu_seq_lens`` (the cumulative lengths over the flattened row, as ``transformers``'
packed path and ``flash_attn_varlen_func`` take them). :func:`batch_layout` turns these into what the
batch-invariant attention reads: each token's sequence and position in it, and each sequence's keys in
order, so a packed or padded sequence sees exactly the keys the engine's request sees, reduced in the
same blocks from its own position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """The sequences of one ``[batch, length]`` call: ``sequence``/``positions`` per token (row-major, the
    ``batch * length`` tokens), and ``keys`` ``[sequences, longest]``: the flat token index of each
    sequence's tokens in order (entries past a sequence's end point at token 0 and are never read)."""

    sequence: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor


def batch_layout(batch: int, length: int, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                 cu_seq_lens: torch.Tensor | None, device: torch.device) -> BatchLayout:
    """Split ``batch`` rows of ``length`` tokens into sequences.

    A sequence starts at a row's first token, where the 2D ``attention_mask`` (1 = a token, 0 = padding)
    switches between padding and tokens, at each ``cu_seq_lens`` offset (a packed row, ``batch`` 1), and
    where ``position_ids`` does not go on by one (a packed row's next sequence). A run of padding is a
    sequence of its own (its outputs are finite and read by no token). Every sequence of tokens must start at
    position 0, as the engine's do: otherwise its rotary positions are not the engine's and the call is
    refused with what to pass instead.
    """
    tokens = batch * length
    index = torch.arange(tokens, device=device)
    column = index % length
    start = column == 0
    valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool).reshape(-1)
        start |= torch.cat((valid[:1], valid[1:] != valid[:-1]))
    if cu_seq_lens is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens describes one packed row; got a batch of {batch} rows (flatten the "
                             "sequences into one row, as flash-attention's varlen path takes them)")
        offsets = cu_seq_lens.to(device=device, dtype=torch.long)
        if offsets[-1].item() != length:
            raise ValueError(f"cu_seq_lens ends at {offsets[-1].item()} but the packed row has {length} tokens")
        start[offsets[:-1]] = True
    positions = None
    if position_ids is not None:
        positions = position_ids.to(device).expand(batch, length).reshape(-1)
        start |= torch.cat((start[:1], positions[1:] != positions[:-1] + 1))
    sequence = torch.cumsum(start.long(), 0) - 1
    first = index[start]
    offset = index - first[sequence]
    if positions is not None:
        wrong = offset != positions if valid is None else (offset != positions) & valid
        if bool(wrong.any()):
            token = int(wrong.nonzero()[0])
            raise ValueError(
                f"the sequence holding row {token // length}, token {token % length} starts at position "
                f"{int(positions[first[sequence[token]]])}, but the engine starts every sequence at 0: pass "
                "position_ids restarting at 0 for each sequence (for a left-padded batch "
                "(attention_mask.cumsum(-1) - 1).clamp_min(0); for a packed row the offset of each token in its "
                "sequence)")
    lengths = torch.bincount(sequence)
    keys = torch.zeros((lengths.numel(), int(lengths.max())), dtype=torch.long, device=device)
    keys[sequence, offset] = index
    return BatchLayout(sequence, offset, keys)
