"""``benchmarks/invariant_gpu.py --smoke`` runs end to end on CPU, so the GPU session's cost table cannot rot
unnoticed: a row per batch with positive throughputs, and the mode's request 0 bitwise the same at every batch."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmarks.scripts import run_script
from tests.helpers import script_module

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "invariant_gpu.py"


def test_invariant_gpu_smoke_prints_a_ratio_per_batch(tmp_path):
    """The smoke shape's checkpoint is built here by decode_roofline's ``build_checkpoint`` (``--checkpoint``): this
    process has transformers' model classes imported already, the script's interpreter spent ~4 CPU-s on them."""
    import torch  # noqa: PLC0415

    with script_module("decode_roofline", BENCHMARK.with_name("decode_roofline.py")) as roofline:
        checkpoint = roofline.build_checkpoint("smoke", roofline.LLAMA_SHAPES["smoke"], tmp_path, torch.device("cpu"))
    result = run_script("invariant_gpu.py", "--smoke", "--checkpoint", str(checkpoint), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", result.stdout, re.M)
    assert [int(row[0]) for row in rows] == [1, 4], result.stdout
    for _, base, mode, ratio, base_run, mode_run, run_ratio in rows:
        assert min(int(base), int(mode), int(base_run), int(mode_run)) > 0 and float(ratio) > 0 < float(run_ratio)
    assert "request 0's log probs == at batches 1,4 (invariant): True" in result.stdout
