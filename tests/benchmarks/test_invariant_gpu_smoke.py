"""``benchmarks/invariant_gpu.py --smoke`` runs end to end on CPU, so the GPU session's cost table cannot rot
unnoticed: a row per batch with positive throughputs, and the mode's request 0 bitwise the same at every batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "invariant_gpu.py"


def test_invariant_gpu_smoke_prints_a_ratio_per_batch():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--smoke"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", result.stdout, re.M)
    assert [int(row[0]) for row in rows] == [1, 4], result.stdout
    for _, base, mode, ratio, base_run, mode_run, run_ratio in rows:
        assert min(int(base), int(mode), int(base_run), int(mode_run)) > 0 and float(ratio) > 0 < float(run_ratio)
    assert "request 0's log probs == at batches 1,4 (invariant): True" in result.stdout
