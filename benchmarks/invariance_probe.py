"""What ``--batch-invariant`` relies on from the CPU's math library, probed: a row's bits in the GEMMs and
reductions the mode runs do not depend on the other rows, their count, the row's place, or the columns beside it.

Each probe computes every row (column) once in a reference arrangement and again in other arrangements, and
counts the results that differ (``==`` on the floats):

* ``linear rows``: ``x @ W.T`` (``torch.mm``), a row among ``M`` rows against the same row among 64, for
  every ``M`` a multiple of the row tile up to 64 (``megatron_kernels.invariant.row_tile``: what
  ``invariant.linear`` relies on); the control, fewer rows than the tile, differs in float32 (in bfloat16 only a few shapes of one row do,
  none in ``--quick``'s);
* ``fused columns``: a projection's columns inside a fused weight (q|k|v, gate|up) at an offset, with and
  without bias, against the projection alone (``ColumnParallelLinear``'s single GEMM in the mode);
* ``attention rows``: ``bmm`` of ``[M, D] x [D, 32]`` (scores per key block) and ``[M, 32] x [32, D]``
  (weighted values) for ``M`` a multiple of the tile up to 600 rows, one GEMM alone and batches of 3 and 21,
  against each row computed as row 0 of a GEMM of one tile (``megatron_kernels.invariant_attention``); the
  control, 2 and 3 rows,
  differs;
* ``row sums``: ``sum`` over a contiguous last dimension of 32 (the attention's per-block weight sums), a
  row among any number of rows, at any offset, against the row alone.

    OMP_NUM_THREADS=1 python benchmarks/invariance_probe.py [--quick]
    OMP_NUM_THREADS=2 python benchmarks/invariance_probe.py [--quick]

Exit status 1 when a relied-on probe finds a difference, or a control finds none.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_kernels.invariant import ISA_VARIABLE, row_tile


def linear_rows(dtype: torch.dtype, quick: bool) -> tuple[int, int, int, int]:
    """(shapes checked, relied-on rows differing, control shapes differing, shapes of another row count
    between the row tile and 64 differing: not relied on, told for the record)."""
    generator = torch.Generator().manual_seed(0)
    checked = differ = control = other = 0
    ks = (64, 683, 2048) if quick else (64, 128, 256, 683, 1024, 2048, 4096)
    ns = (16, 256, 683) if quick else (16, 64, 128, 256, 512, 683, 1024, 2048)
    for k in ks:
        for n in ns:
            weight = torch.randn(n, k, generator=generator).to(dtype)
            x = torch.randn(64, k, generator=generator).to(dtype)
            reference = torch.mm(x[:64], weight.t())
            for rows in range(1, 65):
                same = torch.equal(torch.mm(x[:rows], weight.t()), reference[:rows])
                if rows % row_tile() == 0:
                    checked += 1
                    differ += not same
                elif rows < row_tile():
                    control += not same
                else:
                    other += not same
    return checked, differ, control, other


def fused_columns(dtype: torch.dtype, quick: bool) -> tuple[int, int]:
    """(column blocks checked, differing): each part of a fused weight against the part alone."""
    generator = torch.Generator().manual_seed(1)
    checked = differ = 0
    layouts = ((256, 128, 128), (683, 683)) if quick else ((256, 128, 128), (896, 128, 128), (512, 64, 64),
                                                            (683, 683), (2048, 512, 512))
    for k in ((256,) if quick else (64, 256, 896, 2048)):
        for parts in layouts:
            weight = torch.randn(sum(parts), k, generator=generator).to(dtype)
            bias = torch.randn(sum(parts), generator=generator).to(dtype)
            for rows in ((16, 33) if quick else (16, 17, 31, 32, 100, 512)):
                x = torch.randn(rows, k, generator=generator).to(dtype)
                fused, fused_bias = torch.mm(x, weight.t()), torch.addmm(bias, x, weight.t())
                offset = 0
                for width in parts:
                    part = slice(offset, offset + width)
                    checked += 2
                    differ += not torch.equal(torch.mm(x, weight[part].t()), fused[:, part])
                    differ += not torch.equal(torch.addmm(bias[part], x, weight[part].t()), fused_bias[:, part])
                    offset += width
    return checked, differ


def attention_rows(quick: bool) -> tuple[int, int, int]:
    """(shapes checked, differing, control shapes differing) for the attention's two GEMM forms: row counts
    that are multiples of the tile are relied on, 2 and 3 rows are the control, others are not used."""
    generator = torch.Generator().manual_seed(2)
    checked = differ = control = 0
    tile = row_tile()
    for dim in ((32, 128) if quick else (8, 16, 32, 64, 80, 96, 128, 256)):
        for transposed, (k, n) in ((True, (dim, 32)), (False, (32, dim))):  # scores, weighted values
            a = torch.randn(3, 600, k, generator=generator)
            b = torch.randn(3, n, k, generator=generator).transpose(1, 2) if transposed else \
                torch.randn(3, k, n, generator=generator)
            filler = torch.randn(3, tile - 1, k, generator=generator)
            reference = torch.stack([torch.bmm(torch.cat([a[:, i:i + 1], filler], 1), b)[:, 0]
                                     for i in range(600 if not quick else 64)], 1)
            counts = [2, 3, *range(tile, 65, tile)] + ([] if quick else [128, 200, 512, 600])
            for rows in counts:
                for repeat in (0, 1, 7):  # 0: one GEMM alone (a batch of 1 is split between threads by rows)
                    if repeat == 0:
                        out, expected = torch.bmm(a[:1, :rows], b[:1]), reference[:1, :rows]
                    else:
                        batch_b = b.repeat(repeat, 1, 1) if not transposed else \
                            b.transpose(1, 2).repeat(repeat, 1, 1).transpose(1, 2)
                        out = torch.bmm(a[:, :rows].repeat(repeat, 1, 1), batch_b)
                        expected = reference[:, :rows].repeat(repeat, 1, 1)
                    same = torch.equal(out, expected)
                    if rows % tile == 0:
                        checked += 1
                        differ += not same
                    elif rows < tile:
                        control += not same
    return checked, differ, control


def row_sums(quick: bool) -> tuple[int, int]:
    """(arrangements checked, differing): a 32-element row's sum among others against alone."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.rand(20000, 32, generator=generator) * torch.rand(20000, 1, generator=generator) * 10
    alone = torch.stack([rows[i].sum() for i in range(2000)])
    checked = differ = 0
    for count in ((1, 7, 100, 1000) if quick else (1, 2, 3, 4, 7, 16, 33, 100, 1000, 1500)):
        for offset in (0, 1, 5, 17, 500):
            checked += 1
            differ += not torch.equal(rows[offset:offset + count].sum(-1), alone[offset:offset + count])
    checked += 1
    differ += not torch.equal(rows.sum(-1)[:2000], alone)  # 20,000 rows: several threads' shares
    return checked, differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a subset of the shapes (seconds, for the tests)")
    args = parser.parse_args()
    tile = row_tile()  # settled before any GEMM here, as the mode settles it (below AMX: invariant.NO_AMX)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"row tile {tile}, {ISA_VARIABLE}={os.environ.get(ISA_VARIABLE)}")
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        checked, differ, control, other = linear_rows(dtype, args.quick)
        print(f"linear rows ({dtype}): {checked} shapes of a multiple of {row_tile()} rows, {differ} differ; "
              f"control (1-{row_tile() - 1} rows): {control} differ; other row counts to 64 (not used): {other} differ")
        failures += ["linear rows"] * bool(differ)
        failures += ["linear control"] * (control == 0 and dtype == torch.float32)  # bf16's 1-row path: rarely
        checked, differ = fused_columns(dtype, args.quick)
        print(f"fused columns ({dtype}): {checked} column blocks, {differ} differ")
        failures += ["fused columns"] * bool(differ)
    checked, differ, control = attention_rows(args.quick)
    print(f"attention rows (float32): {checked} shapes of a multiple of {row_tile()} rows, {differ} differ; "
          f"control (2-3 rows): {control} differ")
    failures += ["attention rows"] * bool(differ) + ["attention control"] * (control == 0)
    checked, differ = row_sums(args.quick)
    print(f"row sums (float32): {checked} arrangements, {differ} differ")
    failures += ["row sums"] * bool(differ)
    print("FAILED: " + ", ".join(failures) if failures else "all probes hold")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
