"""``benchmarks/fleet_scale.py --verbs`` times each lifecycle verb at every engine count, each engine acknowledging
every step it is sent (the benchmark refuses a verb whose step missed an engine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet_scale.py"


def test_the_verbs_complete_at_every_engine_count():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--engines", "4,50", "--queued", "300", "--completions",
                             "100", "--verbs", "--verbs-queued", "500"], capture_output=True, text=True, timeout=300,
                            cwd=BENCHMARK.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.split("verbs, 500 requests submitted", 1)[1]
    assert "| engines | PAUSE ms | REFIT ms | SUSPEND ms | RESUME ms | UNPAUSE ms |" in table
    rows = re.findall(r"^\| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", table, re.M)
    assert [row[0] for row in rows] == ["4", "50"], table
