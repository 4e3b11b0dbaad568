"""``benchmarks/kv_routing.py --smoke`` runs end to end on CPU (real engines, the coordinator's policies), so the
benchmark cannot rot unnoticed: every policy's texts are equal (the script asserts it) and it prints a hit rate for
each."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.scripts import run_script

pytestmark = pytest.mark.timeout(900)


def test_kv_routing_smoke_prints_each_policys_hit_rate_with_texts_unchanged(tiny_llama):
    # two routers, restarted mid-trace: each with a memory of its own, the index rebuilt from the engines' snapshots
    result = run_script("kv_routing.py", "--smoke", "--model", tiny_llama, "--routers", "2", "--restart-at", "10",
                        timeout=880)
    assert result.returncode == 0, result.stderr[-2000:]
    rates = dict(re.findall(r"^\s*(prefix_affinity|kv_aware)\s+([\d.]+)\s", result.stdout, re.M))
    assert set(rates) == {"prefix_affinity", "kv_aware"}, result.stdout
    assert all(0.0 < float(rate) <= 1.0 for rate in rates.values()), result.stdout
    assert "equal under every policy" in result.stdout
    assert "2 router(s), restarted at tick 10" in result.stdout
