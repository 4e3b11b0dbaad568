"""Checks, on the machine at hand, the GEMM properties that the CPU's batch-invariant op set rests on.

On a CPU :mod:`.invariant` and :mod:`.invariant_attention` compute linears and attention with the BLAS's
GEMMs at shapes padded so that a row's bits do not depend on the rows around it: a linear's rows in
multiples of :func:`~.invariant.row_tile`, the attention's query rows too; a fused projection (q|k|v,
gate|up) runs as one GEMM only where its columns equal the separate projections' (:func:`fusion_holds`),
else part by part.
Which shapes keep a row's bits is the library's choice per CPU, not a promise: on MKL 2024.2 an Intel
AVX-512 CPU took other paths below 16 rows (8 rows already rounded otherwise), an AMD EPYC from 4 rows
(multiples of 4) but rounded a GEMM's column differently between column counts that were not multiples
of 16. So the engine asks this module at start, on its own weights' shapes, and refuses the mode with the
failed property named rather than serve log probs that are not what it promises.
``benchmarks/invariance_probe.py`` is the thorough version of the same checks, with controls.

A probe of a small model's shapes takes a few milliseconds; of a 1B model's, well under a second.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from .invariant import KEY_BLOCK, row_tile


def _row_counts() -> tuple[int, ...]:
    """The row counts a probe compares: multiples of the tile the op set pads to, one of them large."""
    tile = row_tile()
    return tile, 2 * tile, 3 * tile, 25 * tile


Linear = tuple[torch.Tensor, tuple[int, ...]]
"""A weight ``[out, in]`` in the compute dtype and the widths of the projections fused in it, in order
(``(out,)`` for one)."""


def linear_problems(linears: Iterable[Linear]) -> list[str]:
    """For each weight shape and dtype: one input row's output, moved to other places among
    :func:`_row_counts` rows, keeps its bits. Returns what failed, one line each (each shape probed once
    per process: engines built one after another in a process ask again)."""
    unique = {(tuple(w.shape), w.dtype): w for w, _parts in linears if w.dim() == 2}
    return [problem for (shape, dtype), weight in unique.items()
            if (problem := _linear_problem(shape, dtype, weight)) is not None]


_LINEAR_CHECKED: dict[tuple[tuple[int, ...], torch.dtype, tuple[int, ...]], str | None] = {}
_FUSION_CHECKED: dict[tuple[tuple[int, ...], torch.dtype, tuple[int, ...], int], bool] = {}


def _rows(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn((max(_row_counts()), shape[1]), generator=torch.Generator().manual_seed(0)).to(dtype)


def _linear_problem(shape: tuple[int, ...], dtype: torch.dtype, weight: torch.Tensor) -> str | None:
    key = (shape, dtype, _row_counts())
    if key not in _LINEAR_CHECKED:
        rows = _rows(shape, dtype)
        expected = torch.mm(rows[:row_tile()], weight.t())[0]
        _LINEAR_CHECKED[key] = None
        for count in _row_counts():
            moved = rows[:count].clone()
            moved[count - 1] = rows[0]
            if not torch.equal(torch.mm(moved, weight.t())[count - 1], expected):
                _LINEAR_CHECKED[key] = f"a linear {shape} {dtype}: a row's output changes at row {count - 1} of {count}"
                break
    return _LINEAR_CHECKED[key]


def fusion_holds(weight: torch.Tensor, parts: tuple[int, ...]) -> bool:
    """Whether each part of a fused weight gets, inside the fused GEMM, the columns of its own GEMM (then a
    fused projection may run as one GEMM and still give a trainer's separate projections' bits)."""
    key = (tuple(weight.shape), weight.dtype, parts, row_tile())
    if key not in _FUSION_CHECKED:
        rows = _rows(key[0], weight.dtype)[:row_tile()]
        fused, offset, holds = torch.mm(rows, weight.t()), 0, True
        for width in parts:
            holds = holds and torch.equal(torch.mm(rows, weight[offset:offset + width].t()),
                                          fused[:, offset:offset + width])
            offset += width
        _FUSION_CHECKED[key] = holds
    return _FUSION_CHECKED[key]


def column_split_problems(splits: Iterable[tuple[tuple[int, int], torch.dtype, tuple[int, ...]]]) -> list[str]:
    """For each weight shape ``(out, in)``, dtype and split of its output columns (the widths tensor-parallel ranks
    hold): whether each slice's GEMM gives the same columns of the whole GEMM, as one rank computes them (what
    expert parallelism over tensor-parallel ranks needs to be one rank's bits under ``--batch-invariant``). Returns
    what failed, one line each."""
    problems = []
    for shape, dtype, parts in dict.fromkeys(splits):
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        if not fusion_holds(weight, parts):
            problems.append(f"a linear {shape} {dtype}: its output columns in slices of {parts} round otherwise "
                            "than in one GEMM")
    return problems


def attention_problems(head_dim: int) -> tuple[str, ...]:
    """The attention's two GEMMs per key block (scores ``[M, D] x [D, KEY_BLOCK]``, weighted values
    ``[M, KEY_BLOCK] x [KEY_BLOCK, D]``, float32): a query row keeps its bits among :func:`_row_counts`
    rows, at any place and whatever the batch count."""
    return _attention_problems(head_dim, _row_counts())


@functools.cache
def _attention_problems(head_dim: int, counts: tuple[int, ...]) -> tuple[str, ...]:
    generator = torch.Generator().manual_seed(1)
    problems = []
    for name, depth, width in (("scores", head_dim, KEY_BLOCK), ("weighted values", KEY_BLOCK, head_dim)):
        rows = torch.randn((3, max(counts), depth), generator=generator)
        right = torch.randn((3, depth, width), generator=generator)
        expected = torch.bmm(rows[:1, :max(counts)], right[:1])[0, 0]
        failed = _row_moves(rows, right, expected, counts)
        if failed:
            problems.append(f"the attention's {name} GEMM [M, {depth}] x [{depth}, {width}]: a row changes {failed}")
    return tuple(problems)


def _row_moves(rows: torch.Tensor, right: torch.Tensor, expected: torch.Tensor, counts: tuple[int, ...]
               ) -> str | None:
    """Where row 0 of the first batch entry, moved among other rows and batch entries, loses its bits."""
    for batch in (1, 3):
        for count in counts:
            for place in {0, min(5, count - 1), count - 1}:
                moved = rows[:batch, :count].clone()
                moved[0, place] = rows[0, 0]
                if not torch.equal(torch.bmm(moved, right[:batch])[0, place], expected):
                    return f"at row {place} of {count} in a batch of {batch}"
    return None


def cpu_problems(linears: Iterable[Linear], head_dim: int) -> list[str]:
    """Every property the CPU op set needs, probed with these linears' shapes and dtypes (empty: all hold)."""
    return linear_problems(linears) + list(attention_problems(head_dim))
