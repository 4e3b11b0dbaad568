"""Batched LoRA for a step whose rows use different adapters (and none): the shrink/expand pair.

Layouts shared with :mod:`megatron_kernels.triton_lora`:

* ``a``: ``[slots, rank, in_features]``, every adapter slot's ``lora_A`` padded with zero rows to the
  table's rank (a fused projection stacks its parts' ranks: q|k|v gives ``3 * max_rank``).
* ``b``: ``[slots, out_features, rank]``, ``lora_B`` times the adapter's scaling, zero-padded likewise.
* ``indices``: int64 ``[tokens]``, each row's slot; ``-1`` is the base model (no delta).

The reference groups the rows by slot and runs two small matmuls per slot the step uses, so its
work is that of the adapters' rows alone. Computing every slot for every row instead (two dense
matmuls of fixed shape, masked) cost as much as the q|k|v projection itself at 8 slots of rank 16
on a 512-wide model: 8 adapters at batch 64 kept 0.82x of the base model's tokens/s in
``benchmarks/lora.py`` (2-core CPU, shared), against the figures in docs/lora.md with grouping.
Finding the groups reads ``indices`` on the host: this is the CPU path (the GPU runs the Triton twin).
"""

from __future__ import annotations

import torch


def _groups(indices: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(slot, rows)`` of every slot some row uses (base rows, slot -1, left out)."""
    return [(slot, (indices == slot).nonzero().squeeze(1)) for slot in torch.unique(indices).tolist() if slot >= 0]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``h[t] = x[t] @ a[indices[t]].T`` (zeros where ``indices[t] < 0``): ``[tokens, rank]``."""
    h = x.new_zeros(x.shape[0], a.shape[1])
    for slot, rows in _groups(indices):
        h[rows] = x[rows] @ a[slot].T
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, indices: torch.Tensor) -> None:
    """``y[t] += h[t] @ b[indices[t]].T`` in place, for rows with an adapter."""
    for slot, rows in _groups(indices):
        y.index_add_(0, rows, h[rows] @ b[slot].T)
