"""``benchmarks/trainer_recipe.py`` runs end to end at a small size: a row per batch layout and pass, with
positive CPU times and a ratio (the figures in docs/batch-invariance.md come from a full-size run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_recipe.py"


def test_trainer_recipe_benchmark_prints_a_ratio_per_layout_and_pass():
    result = subprocess.run([sys.executable, str(BENCHMARK), "--batch", "3", "--length", "64", "--hidden-size", "64",
                             "--layers", "1", "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^(right-padded|packed)\s+(forward \(log probs\)|forward \+ backward)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)x$", result.stdout, re.M)
    assert [(r[0], r[1]) for r in rows] == [(layout, p) for layout in ("right-padded", "packed")
                                            for p in ("forward (log probs)", "forward + backward")], result.stdout
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
