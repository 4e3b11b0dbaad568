"""``benchmarks/invariance_counts.py`` (the counts docs/batch-invariance.md shows, on the model a newcomer makes)
runs, finds every log prob equal with ``--batch-invariant``, and some differ without it on this machine, so that
the comparison can fail (its control)."""

from __future__ import annotations

from tests.benchmarks.scripts import run_script


def test_counts_the_differences_the_mode_removes():
    result = run_script("invariance_counts.py", "--dtype", "float32")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "float32" in line]
    assert len(rows) == 4, result.stdout
    assert all(row[3] == "equal |" for row in rows), result.stdout
    assert any("differ" in row[2] for row in rows), result.stdout
