"""Batched LoRA under ``--batch-invariant``: every row's delta computed on its own, so an adapter row's result
does not depend on the other rows of its step.

The reference (:mod:`.reference_lora`) multiplies each slot's rows as one slice: the slice's row count is
the number of rows of that adapter in the step, and the library's GEMM picks its algorithm by it (one row:
a matrix-vector product), so the same request's delta rounds differently alone and in a busy batch. Here
each row gathers its slot's ``A`` and ``B`` and reduces its own products along the last dimension (PyTorch
reduces a contiguous last dimension row by row and never splits it across threads), base rows multiplied by
zero. A per-row ``bmm`` is not enough: with one batch entry PyTorch takes another kernel than with several
(rank 24 over 32 inputs: the same row differs alone and among 2-50). It is also what a captured decode step computes (:meth:`~.reference_lora.LoraBatch.of_padded`:
fixed shapes, no host value), so graph and eager steps agree bit for bit. The add into the projection's
output is one correctly rounded ``+`` per element (a base row adds exact zeros).
"""

from __future__ import annotations

import torch

from . import invariant
from .reference_lora import LoraBatch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """``x[t] @ a[slot of t].T`` for every row ``t`` (zeros for base rows): ``[tokens, rank]``."""
    h = (a[batch.indices.clamp(min=0)] * x.unsqueeze(1)).sum(-1)
    return h * (batch.indices >= 0).unsqueeze(-1).to(h.dtype)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """``y[t] += h[t] @ b[slot of t].T`` in place (``h`` from :func:`lora_shrink`: zero on base rows)."""
    y += (b[batch.indices.clamp(min=0)] * h.unsqueeze(1)).sum(-1)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, a_gate_up: torch.Tensor, b_gate_up: torch.Tensor,
               down: torch.Tensor, a_down: torch.Tensor, b_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP on rows ``x`` with ``W + B A`` in both projections, row for row the same
    whatever other rows ``x`` holds."""
    h = invariant.linear(x, gate_up) + invariant.linear(invariant.linear(x, a_gate_up), b_gate_up)
    act = invariant.silu_and_mul(h)
    return invariant.linear(act, down) + invariant.linear(invariant.linear(act, a_down), b_down)
