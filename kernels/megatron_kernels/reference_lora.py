"""Batched LoRA for a step whose rows use different adapters (and none): the shrink/expand pair.

Layouts shared with :mod:`megatron_kernels.triton_lora`:

* ``a``: ``[slots, rank, in_features]``, every adapter slot's ``lora_A`` padded with zero rows to the
  table's rank (a fused projection stacks its parts' ranks: q|k|v gives ``3 * max_rank``).
* ``b``: ``[slots, out_features, rank]``, ``lora_B`` times the adapter's scaling, zero-padded likewise.
* ``batch``: the step's :class:`LoraBatch`, built once per step: each row's slot (``-1``: the base
  model, no delta), the runs of consecutive rows of one slot, and the adapter rows grouped by slot.

The weight tables may have any strides (the model stores them transposed, as a GEMM reads them:
:mod:`megatron_serve.model.lora.slots`). ``lora_shrink``'s result is only for ``lora_expand`` of the same
implementation (its row layout is the implementation's).

The reference multiplies each run of rows of one slot as a slice of the activations: one matmul into ``h``
and one in-place ``addmm_`` into the output per run, no gather, no scatter. The engine orders each step's
rows by slot (:func:`megatron_serve.engine.scheduler.step_order`), so a step holds one run per adapter
(two when it mixes decode and prefill rows). Earlier forms cost more in ``benchmarks/lora.py`` (8 adapters
at batch 64, rank 16 on every projection, hidden 512, a 2-core CPU shared with other work, tokens per CPU
second against the base model): every slot for every row, masked (fixed shapes): 0.82x wall; one
``unique``/``nonzero``/gather/``index_add_`` per slot and projection: 0.61x; the adapter rows gathered
sorted by slot once per projection and added back with one ``index_add_``: 0.83-0.86x (the adapter hooks
alone: 4.97 ms a decode step, 62.5 ms the 2048-row prefill step). This form: 3.72 and 44.7 ms in the same
micro-benchmark, 0.87x to 0.90x (docs/lora.md, "Speed"). With 8 adapters a decode step's cost is mostly
reading the 8 adapters' weights (19 MB a step at this shape, 40% of the base model's): one adapter for
every row costs 1.7 ms a step, 8 runs of one adapter 2.0 ms, 8 adapters 3.3 ms.

A padded batch (:meth:`LoraBatch.of_padded`, decode steps replayed from CUDA graphs) gathers every row's slot
weights on the device instead: fixed shapes, no host value, at the cost of one ``[rows, rank, in]`` gather per
projection (on GPUs the Triton kernels, which read each row's slot themselves, serve both forms alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraBatch:
    """One step's adapter rows, built once per step: ``indices`` (int64 ``[tokens]`` on the device, what the Triton
    kernels read); ``runs`` and ``sizes``: the rows cut into runs of one slot each (``runs[i]`` the slot of the
    ``sizes[i]`` rows that follow the previous run, ``-1``: base rows), what the reference multiplies slice by slice;
    ``order`` (the adapter rows sorted by slot) and ``segments`` (``(slot, start, end)`` in ``order``): each slot's
    rows in one index, for the MoE expert hook."""

    indices: torch.Tensor
    order: torch.Tensor | None
    segments: tuple[tuple[int, int, int], ...]
    runs: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    padded: bool = False  # every row by its slot, read on the device only: what a CUDA graph can hold

    @classmethod
    def of_padded(cls, indices: torch.Tensor) -> "LoraBatch":
        """The rows of a captured step: ``indices`` is the step buffer the graph reads each slot from at replay
        (``-1``: the base model or a padding row); no host value, so nothing is fixed at capture but shapes."""
        return cls(indices, None, (), padded=True)

    @classmethod
    def of(cls, indices: torch.Tensor, host: np.ndarray) -> "LoraBatch":
        """From the step's slot per row, on the device (``indices``) and on the host (``host``, the same values)."""
        rows = np.flatnonzero(host >= 0)
        order = rows[np.argsort(host[rows], kind="stable")]
        slots = host[order]
        starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]]) if len(order) else np.empty(0, np.int64)
        ends = np.r_[starts[1:], len(order)]
        segments = tuple((int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends))
        firsts = np.flatnonzero(np.r_[True, host[1:] != host[:-1]]) if len(host) else np.empty(0, np.int64)
        sizes = np.diff(np.r_[firsts, len(host)])
        return cls(indices, torch.from_numpy(order).to(indices.device, non_blocking=True), segments,
                   tuple(host[firsts].tolist()), tuple(sizes.tolist()))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """``x[t] @ a[slot of t].T`` for the adapter rows: ``[tokens, rank]`` (base rows unset; zeros in a padded batch)."""
    if batch.padded:
        used = batch.indices >= 0
        h = torch.bmm(a[batch.indices.clamp(min=0)], x.unsqueeze(-1)).squeeze(-1)
        return h * used.unsqueeze(-1).to(h.dtype)
    h = x.new_empty(x.shape[0], a.shape[1])
    weights = a.transpose(1, 2).unbind(0)
    for slot, rows, out in zip(batch.runs, x.split(batch.sizes), h.split(batch.sizes)):
        if slot >= 0:
            torch.matmul(rows, weights[slot], out=out)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """``y[t] += h[t] @ b[slot of t].T`` in place, for rows with an adapter."""
    if batch.padded:  # h is zero on base rows: their delta is zero
        y += torch.bmm(b[batch.indices.clamp(min=0)], h.unsqueeze(-1)).squeeze(-1)
        return
    weights = b.transpose(1, 2).unbind(0)
    for slot, rows, out in zip(batch.runs, h.split(batch.sizes), y.split(batch.sizes)):
        if slot >= 0:
            out.addmm_(rows, weights[slot])


def slot_table(slots: int, rows: int, columns: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A zero ``[slots, rows, columns]`` adapter table in the kernels' layout. On CPU its memory is ``[slots,
    columns, rows]`` (a transposed view): the reference's small per-adapter GEMMs read their weight operand
    untransposed, with no packing of a transposed copy (decode steps with 8 adapters: -13% in the hooks in a
    cold-cache micro-benchmark, -4% in the engine). Elsewhere the Triton kernels read rows of it, contiguous as
    they always were. The layout is part of the arithmetic: the batch-invariant sums reduce along its strides,
    so a trainer replaying the engine's LoRA (``megatron_serve.invariant.use_invariant_lora``) builds the same."""
    if torch.device(device).type != "cpu":
        return torch.zeros(slots, rows, columns, device=device, dtype=dtype)
    return torch.zeros(slots, columns, rows, device=device, dtype=dtype).transpose(1, 2)
