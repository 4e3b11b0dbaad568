"""``benchmarks/dense_rows.py`` times each CPU GEMM path at each row count, after checking that every path computes
the same product (issue 84, item 6)."""

from __future__ import annotations

import pytest
from megatron_kernels import dense

from tests.benchmarks.scripts import run_script


@pytest.mark.skipif(not dense.BLOCKED, reason="torch without oneDNN's weight reorder")
def test_a_row_per_shape_and_row_count_names_the_fastest_path():
    result = run_script("dense_rows.py", "--shapes", "96x64,64x128", "--rows", "1,3", "--rounds", "2",
                        "--stream-mb", "0.05")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "x" in line
            and "shape" not in line]
    assert [(cells[0].split()[0], cells[1].strip()) for cells in rows] == [
        ("96x64", "1"), ("96x64", "3"), ("64x128", "1"), ("64x128", "3")], result.stdout
    for cells in rows:
        timings, fastest = cells[2:-1], cells[-1].strip()
        assert len(timings) == 5 and all(float(cell.split()[0]) >= 0 for cell in timings)
        assert fastest in ("onednn64", "onednn_rows", "onednn_plain", "mkl", "mkl_packed")
