"""Checks, on the machine at hand, the GEMM properties that the CPU's batch-invariant op set rests on.

On a CPU :mod:`.invariant` computes its linears and attention with the BLAS's GEMMs, padded to shapes whose
elements the library computes the same way whatever the other rows and columns: a linear's rows in
multiples of :data:`~.invariant.ROW_TILE`, the attention's query columns in multiples of
:data:`~.invariant.GEMM_COLUMNS`. Which shapes those are is the library's choice per CPU, not a promise:
MKL 2024.2 computed a column the same for every column count from 2 on an Intel AVX-512 CPU, but only
within the multiples of 16 on an AMD EPYC, where the 2-column form silently changed 1-3 of 16 log probs
in the last bits. So the engine asks this module at start, on its own weights' shapes, and refuses the
mode with the failed property named rather than serve log probs that are not what it promises.

A probe of a small model's shapes takes a few milliseconds; of a 1B model's, well under a second.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from .invariant import GEMM_COLUMNS, KEY_BLOCK, ROW_TILE

_ROW_COUNTS = (ROW_TILE, 2 * ROW_TILE, 3 * ROW_TILE, 5 * ROW_TILE)
_COLUMN_COUNTS = (GEMM_COLUMNS, 2 * GEMM_COLUMNS, 3 * GEMM_COLUMNS, 7 * GEMM_COLUMNS)
_SPANS = (KEY_BLOCK, 3 * KEY_BLOCK)


def linear_problems(weights: Iterable[torch.Tensor]) -> list[str]:
    """For each weight shape ``[out, in]`` and dtype: one input row's output row, moved to other places among
    :data:`_ROW_COUNTS` rows, must keep its bits. Returns what failed, one line each (each shape probed once
    per process: engines built one after another in a process ask again)."""
    shapes = {(tuple(w.shape), w.dtype): w for w in weights if w.dim() == 2}
    return [problem for (shape, dtype), weight in shapes.items()
            if (problem := _linear_problem(shape, dtype, weight)) is not None]


_LINEAR_CHECKED: dict[tuple[tuple[int, ...], torch.dtype], str | None] = {}


def _linear_problem(shape: tuple[int, ...], dtype: torch.dtype, weight: torch.Tensor) -> str | None:
    key = (shape, dtype)
    if key not in _LINEAR_CHECKED:
        generator = torch.Generator().manual_seed(0)
        rows = torch.randn((max(_ROW_COUNTS), shape[1]), generator=generator).to(dtype)
        expected = torch.mm(rows[:ROW_TILE], weight.t())[3]
        _LINEAR_CHECKED[key] = None
        for count in _ROW_COUNTS:
            moved = rows[:count].clone()
            moved[count - 1] = rows[3]
            if not torch.equal(torch.mm(moved, weight.t())[count - 1], expected):
                _LINEAR_CHECKED[key] = f"a linear {shape} {dtype}: a row's output changes at row {count - 1} of {count}"
                break
    return _LINEAR_CHECKED[key]


@functools.cache
def attention_problems(head_dim: int) -> tuple[str, ...]:
    """The attention's three batched GEMMs (scores ``[span, D] x [D, N]``, weighted values ``[D, KEY_BLOCK] x
    [KEY_BLOCK, N]``, weight sums ``[8, KEY_BLOCK] x [KEY_BLOCK, N]``, float32): a query column must keep its
    bits wherever it stands among :data:`_COLUMN_COUNTS` columns and whatever the batch count."""
    generator = torch.Generator().manual_seed(1)
    problems = []
    for name, rows, depth in (("scores", None, head_dim), ("weighted values", head_dim, KEY_BLOCK),
                              ("weight sums", 8, KEY_BLOCK)):
        for span in (_SPANS if rows is None else (rows,)):
            left = torch.randn((3, span, depth), generator=generator)
            columns = torch.randn((3, max(_COLUMN_COUNTS), depth), generator=generator)
            expected = torch.bmm(left[:1], columns[:1, :GEMM_COLUMNS].transpose(1, 2))[0, :, 0]
            failed = _column_moves(left, columns, expected)
            if failed:
                problems.append(f"the attention's {name} GEMM [{span}, {depth}] x [{depth}, N]: a column changes "
                                f"{failed}")
    return tuple(problems)


def _column_moves(left: torch.Tensor, columns: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Where column 0 of the first batch entry, moved among other columns and batch entries, loses its bits."""
    for batch in (1, 3):
        for count in _COLUMN_COUNTS:
            for place in {0, min(5, count - 1), count - 1}:
                moved = columns[:batch, :count].clone()
                moved[0, place] = columns[0, 0]
                if not torch.equal(torch.bmm(left[:batch], moved.transpose(1, 2))[0, :, place], expected):
                    return f"at column {place} of {count} in a batch of {batch}"
    return None


def cpu_problems(weights: Iterable[torch.Tensor], head_dim: int) -> list[str]:
    """Every property the CPU op set needs, probed with these weights' shapes and dtypes (empty: all hold)."""
    return linear_problems(weights) + list(attention_problems(head_dim))
