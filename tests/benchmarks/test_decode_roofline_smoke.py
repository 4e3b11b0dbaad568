"""``benchmarks/decode_roofline.py --smoke`` runs end to end on CPU, so the GPU benchmark cannot rot unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmarks.scripts import run_script
from tests.helpers import script_module

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_roofline.py"


def test_decode_roofline_smoke_prints_a_row_per_batch(tmp_path):
    """The smoke shape's checkpoint is built here by the script's own ``build_checkpoint`` (``--checkpoint``): this
    process has transformers' model classes imported already, the script's interpreter spent ~4 CPU-s on them."""
    import torch  # noqa: PLC0415

    with script_module("decode_roofline", BENCHMARK) as roofline:
        checkpoint = roofline.build_checkpoint("smoke", roofline.LLAMA_SHAPES["smoke"], tmp_path, torch.device("cpu"))
    result = run_script("decode_roofline.py", "--smoke", "--no-hf", "--checkpoint", str(checkpoint), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\s*smoke\s+(\d+)\s+\d+\s+(\d+)\s+(\d+)\s+[\d.]+%\s+(\d+)\s+(\d+)", result.stdout, re.M)
    assert [int(batch) for batch, *_ in rows] == [1, 4], result.stdout
    for _, bound, engine, eager, replay in rows:
        assert 0 < int(engine) < int(bound) and int(eager) > 0 and int(replay) > 0
    assert "failed" not in result.stdout
