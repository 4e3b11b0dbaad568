"""``benchmarks/kv_tiers.py --smoke`` runs end to end on CPU, so the benchmark cannot rot unnoticed."""

from __future__ import annotations

import re

from tests.benchmarks.scripts import run_script


def test_kv_tiers_smoke_finds_prefixes_on_the_host_and_on_disk_and_keeps_the_kv(tiny_llama):
    result = run_script("kv_tiers.py", "--smoke", "--model", tiny_llama, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    hits = re.search(r"^\s*tier on\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)$", result.stdout, re.M)
    assert hits is not None and int(hits.group(2)) > 0, result.stdout
    off = re.search(r"^\s*tier off\s+[\d.]+\s+[\d.]+\s+\d+\s+(\d+)$", result.stdout, re.M)
    assert off is not None and int(off.group(1)) == 0, result.stdout
    disk = re.search(r"^\s*disk hit\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", result.stdout, re.M)
    assert disk is not None and int(disk.group(1)) > 0, result.stdout  # engine B found engine A's blocks on disk
    computed = re.search(r"^\s*recompute\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", result.stdout, re.M)
    assert computed is not None and int(computed.group(1)) == 0, result.stdout
    on_step = re.search(r"file writes: ([\d.]+) ms on the step thread.*file reads: ([\d.]+) ms on the step thread",
                        result.stdout)
    assert on_step is not None and on_step.groups() == ("0.0", "0.0"), result.stdout  # the disk I/O is off the step
    rows = dict(re.findall(r"^\s*(recompute|keep_kv)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+(\d+)$", result.stdout, re.M))
    assert int(rows["keep_kv"]) < int(rows["recompute"]), result.stdout  # only the new tokens, not the contexts
