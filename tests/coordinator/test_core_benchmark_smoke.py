"""``benchmarks/coordinator_core.py`` runs end to end, so the core's CPU benchmark cannot rot unnoticed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "coordinator_core.py"


def test_the_core_benchmark_replays_requests_and_prints_microseconds_per_request():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--requests", "600", "--rounds", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"best ([\d.]+) us/request, median ([\d.]+) \(([\d.]+) ([\d.]+)\)", result.stdout)
    assert found, result.stdout
    best, median, *rounds = map(float, found.groups())
    assert 0 < best <= median and min(rounds) == best
