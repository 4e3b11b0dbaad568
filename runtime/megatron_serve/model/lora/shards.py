"""Where a rank's share of a LoRA adapter lies: adapters are split over tensor-parallel ranks like their base layers.

A column-parallel projection (q|k|v, gate|up) holds a slice of each part's output features, so a rank keeps
all of ``A`` (replicated) and ``B``'s rows of its slice: its delta is exactly its slice of the full delta, with
no communication. A row-parallel projection (``o_proj``, ``down_proj``) holds a slice of the input features:
a rank keeps ``A``'s columns of its slice and all of ``B`` (replicated), and its delta ``(x_r A_r^T) B^T`` is a
partial sum like the base layer's ``x_r W_r^T``. The two are added before one reduction: the projection's own
reduction moves into the LoRA hook (:func:`lora_shard` turns the layer's off), which adds the delta and then
reduces as the layer would (the all-reduce, or the fixed-order sum of ``--batch-invariant``). So adapters add
no collective to a step, and a step without adapter rows reduces the same tensor the layer reduced before.

Where the layers compute one rank's bits instead (:attr:`~..parallel.TensorParallel.gathered_rows`:
``--batch-invariant`` under expert parallelism at TP > 1), so do their adapters' deltas, each computed whole with
one rank's ops in one rank's order. A row-parallel projection (:class:`~..layers.GatheredRowLinear`) has no partial
sums to join: its hook sees the whole input and the whole output, so every rank keeps the layer's ``A`` and ``B``
whole, as one rank's slots do, and adds the whole delta. A column-parallel one keeps ``B`` whole too
(:attr:`LoraShard.whole`): the batch-invariant expand reduces along the slot table's strides
(``megatron_kernels.reference_lora.slot_table``), so a table of a slice of ``B``'s rows rounds some columns otherwise
than the whole (k and v of 16 columns a rank in 32, on an AVX-512 CPU); the rank computes the part's whole delta and
adds its columns. Every rank computes every delta (``rank * (in + out)`` products a token, beside the layer's
``in * out / tp``), and no collective is added.

MoE experts (:func:`expert_share`) split the same way, expert by expert: every rank holds the same slice of each
expert's intermediate dimension, so ``gate_up_proj`` is column-parallel (``A`` replicated, ``B``'s rows of the
rank's gate slice and of its up slice) and ``down_proj`` row-parallel (``A``'s columns of the slice, ``B``
replicated). The expert hook recomputes a row's experts with ``W + B A`` from these shares: the rank's result is
a partial sum like the fused kernel's, and joins the MoE block's one reduction with the shared expert's. Under
expert parallelism a rank keeps whole experts, so it keeps those experts' ``A`` and ``B`` whole, one row per slot of
its stack (under EPLB a replica's row is its logical expert's; the slots re-cut them when experts move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .experts import EXPERT_PROJECTIONS
from ..experts.moe import FusedExperts
from ..layers import GatheredRowLinear
from ..parallel import TensorParallel


@dataclass(frozen=True)
class LoraShard:
    """A rank's share: ``out_rows[part] = (offset in this rank's output, start in the part's B, length)``,
    ``in_columns = (start in A, length)``; ``tp``: the group whose reduction the LoRA hook performs (row-parallel
    projections under TP only, else None); ``whole``: the rank keeps each part's ``B`` whole and adds its
    ``out_rows`` of the part's whole delta (column-parallel projections under ``gathered_rows``: one rank's bits)."""

    out_rows: dict[str, tuple[int, int, int]]
    in_columns: tuple[int, int]
    tp: TensorParallel | None
    whole: bool = False


def lora_shard(module: nn.Module, parts: tuple[str, ...], shapes: list[tuple[int, int]]) -> LoraShard:
    """The share of ``module`` (a projection fusing ``parts`` of checkpoint ``(out, in)`` ``shapes``) on this rank.
    Under TP a row-parallel ``module`` stops reducing its output: the LoRA hook reduces it (see the module doc); a
    gathered one keeps the whole adapter, as one rank does."""
    in_features = shapes[0][1]
    tp: TensorParallel | None = getattr(module, "tp", None)
    if tp is None or tp.size == 1 or isinstance(module, GatheredRowLinear):
        rows, offset = {}, 0
        for part, (out_features, _) in zip(parts, shapes):
            rows[part] = (offset, 0, out_features)
            offset += out_features
        return LoraShard(rows, (0, in_features), None)
    slices = getattr(module, "slices", None)
    if slices is not None:  # column-parallel: ColumnParallelLinear names its fused parts q, k, v / gate, up
        names = list(slices)
        if len(names) != len(parts):
            raise ValueError(f"LoRA: {type(module).__name__} fuses {names}, not {list(parts)}")
        return LoraShard({part: slices[name] for part, name in zip(parts, names)}, (0, in_features), None,
                         tp.gathered_rows)
    local_in = getattr(module, "local_in", None)
    if local_in is None or not getattr(module, "reduce", False):
        raise ValueError(f"LoRA adapters cannot be split over tensor-parallel ranks in a {type(module).__name__}")
    module.reduce = False  # the hook adds the delta to the partial sums, then reduces them
    out_features = shapes[0][0]
    return LoraShard({parts[0]: (0, 0, out_features)}, (tp.rank * local_in, local_in), tp)


def expert_share(projection: str, a: torch.Tensor, b: torch.Tensor, experts: FusedExperts
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of an expert projection's adapter (``A [E, r, in]``, ``B [E, out, r]``) for the experts it
    holds: its experts whole under expert parallelism; otherwise, when each rank holds ``experts.local`` columns of
    every expert's intermediate dimension, ``gate_up_proj`` keeps all of ``A`` and ``B``'s rows of its gate slice
    then of its up slice (the fused parameter's layout), ``down_proj`` keeps ``A``'s columns of its slice and all
    of ``B``."""
    tp, local, start = experts.tp, experts.local, experts.start
    if tp.expert_parallel:
        return a[experts.slots], b[experts.slots]
    if tp.size == 1:
        return a, b
    if projection == EXPERT_PROJECTIONS[0]:
        inner = b.shape[1] // 2
        return a, torch.cat((b[:, start : start + local], b[:, inner + start : inner + start + local]), dim=1)
    return a[:, :, start : start + local], b
