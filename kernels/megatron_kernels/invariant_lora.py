"""Batched LoRA under ``--batch-invariant``: :mod:`.reference_lora`'s shrink/expand pair with every matmul
through :func:`.invariant.linear`, so an adapter row's delta does not depend on the other rows of its step.

The reference multiplies each slot's rows as one slice: the slice's row count is the number of rows of
that adapter in the step, and the library's GEMM picks its algorithm by it (one row: a matrix-vector
product), so the same request's delta rounds differently alone and in a busy batch. Padding the slice to
whole :data:`~.invariant.ROW_TILE` tiles takes that choice away. The add back into the projection's
output is one correctly rounded ``+`` per element (each row appears once), so it needs nothing.
Layouts and :class:`~.reference_lora.LoraBatch` are the reference's.
"""

from __future__ import annotations

import torch

from . import invariant
from .reference_lora import LoraBatch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """``x[t] @ a[slot of t].T`` for the adapter rows, in ``batch.order``: ``[adapter rows, rank]``."""
    rows = x if batch.whole else x[batch.order]
    h = rows.new_empty(rows.shape[0], a.shape[1])
    for slot, start, end in batch.segments:
        h[start:end] = invariant.linear(rows[start:end], a[slot])
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """``y[t] += h[t] @ b[slot of t].T`` in place, for rows with an adapter."""
    delta = h.new_empty(h.shape[0], b.shape[1])
    for slot, start, end in batch.segments:
        delta[start:end] = invariant.linear(h[start:end], b[slot])
    if batch.whole:
        y += delta
    else:
        y.index_add_(0, batch.order, delta)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, a_gate_up: torch.Tensor, b_gate_up: torch.Tensor,
               down: torch.Tensor, a_down: torch.Tensor, b_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP on rows ``x`` with ``W + B A`` in both projections, row for row the same
    whatever other rows ``x`` holds."""
    h = invariant.linear(x, gate_up) + invariant.linear(invariant.linear(x, a_gate_up), b_gate_up)
    act = invariant.silu_and_mul(h)
    return invariant.linear(act, down) + invariant.linear(invariant.linear(act, a_down), b_down)
