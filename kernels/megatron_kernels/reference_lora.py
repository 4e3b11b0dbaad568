"""Batched LoRA for a step whose rows use different adapters (and none): the shrink/expand pair.

Layouts shared with :mod:`megatron_kernels.triton_lora`:

* ``a``: ``[slots, rank, in_features]``, every adapter slot's ``lora_A`` padded with zero rows to the
  table's rank (a fused projection stacks its parts' ranks: q|k|v gives ``3 * max_rank``).
* ``b``: ``[slots, out_features, rank]``, ``lora_B`` times the adapter's scaling, zero-padded likewise.
* ``indices``: int64 ``[tokens]``, each row's slot; ``-1`` is the base model (no delta).

The reference computes every slot for every row and keeps each row's own slot: two dense matmuls with
fixed shapes, no host synchronisation and no per-slot Python loop, so its cost does not depend on how
many adapters a step mixes. The extra work is ``tokens * slots * rank * (in + out)`` multiply-adds:
with 8 slots of rank 16 on a 1024-wide layer that is about an eighth of the base projection.
"""

from __future__ import annotations

import torch


def _slot_mask(indices: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, slots, 1]``: 1 at each row's own slot, all zeros for a base row."""
    own = indices.unsqueeze(1) == torch.arange(slots, device=indices.device).unsqueeze(0)
    return own.to(dtype).unsqueeze(-1)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``h[t] = x[t] @ a[indices[t]].T`` (zeros where ``indices[t] < 0``): ``[tokens, rank]``."""
    slots, rank, _ = a.shape
    every = x @ a.reshape(slots * rank, -1).T  # [tokens, slots * rank]
    return (every.view(-1, slots, rank) * _slot_mask(indices, slots, every.dtype)).sum(1)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, indices: torch.Tensor) -> None:
    """``y[t] += h[t] @ b[indices[t]].T`` in place, for rows with an adapter."""
    slots, out_features, rank = b.shape
    spread = (h.unsqueeze(1) * _slot_mask(indices, slots, h.dtype)).reshape(-1, slots * rank)
    y += spread @ b.permute(1, 0, 2).reshape(out_features, slots * rank).T
