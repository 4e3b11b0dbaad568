"""``benchmarks/fleet_scale.py`` runs end to end at a small size, so the scale benchmark cannot rot unnoticed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet_scale.py"


def test_the_scale_benchmark_prints_a_row_per_size():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--engines", "4,20", "--queued", "500,2000",
                             "--completions", "400"], capture_output=True, text=True, timeout=300, cwd=BENCHMARK.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d,]+) \| ([\d.]+) \| "
                      r"([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.M)
    # 4 engines: the small queue only (the largest runs at the largest fleet); 20 engines: both
    assert [(engines, queued) for engines, queued, *_ in rows] == [("4", "436"), ("20", "180"), ("20", "1,680")], \
        result.stdout
    for row in rows:
        assert all(float(value.replace(",", "")) > 0 for value in row[2:]), row


def test_a_bad_size_is_refused_naming_the_option():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--engines", "0"], capture_output=True, text=True,
                            timeout=60, cwd=BENCHMARK.parent)
    assert result.returncode != 0 and "--engines needs positive counts" in result.stderr
