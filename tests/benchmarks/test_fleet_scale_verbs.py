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


PEER = BENCHMARK.parent / "coordinator_peer.py"


def test_the_coordinator_process_runs_the_verbs_over_zeromq():
    """``coordinator_peer.py --verbs``: the real coordinator process, fake engines speaking the real wire."""
    result = subprocess.run([sys.executable, str(PEER), "--only", "ours", "--engines", "3", "--requests", "200",
                             "--scenarios", "c64", "--verbs", "--verb-rounds", "1"], capture_output=True, text=True,
                            timeout=300, cwd=PEER.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verbs at 3 fake engines (ours), 1 rounds" in result.stdout
    walls = re.search(r"^\| wall ms \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.M)
    assert walls and all(float(v) > 0 for v in walls.groups()), result.stdout
