"""``benchmarks/trainer_recipe.py`` runs end to end at a small size: a row per batch layout and pass, with
positive CPU times and a ratio (the figures in docs/batch-invariance.md come from a full-size run).

The script runs in the test's process (its ``main``): its own interpreter spent most of its CPU importing torch and
transformers' model classes, which this process has imported already."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import script_module

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_recipe.py"


def test_trainer_recipe_benchmark_prints_a_ratio_per_layout_and_pass(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARK), "--batch", "3", "--length", "64", "--hidden-size", "64",
                                      "--layers", "1", "--repeat", "1"])
    with script_module("trainer_recipe", BENCHMARK) as recipe:
        recipe.main()
    out = capsys.readouterr().out
    rows = re.findall(r"^(right-padded|packed)\s+(forward \(log probs\)|forward \+ backward)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)x$", out, re.M)
    assert [(r[0], r[1]) for r in rows] == [(layout, p) for layout in ("right-padded", "packed")
                                            for p in ("forward (log probs)", "forward + backward")], out
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
