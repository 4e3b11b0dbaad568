"""``benchmarks/expert_parallel.py`` and ``benchmarks/pipeline_parallel.py`` run end to end on CPU at a tiny size, so
the benchmarks that ``gpu_session.sh ep`` and ``pp`` run on a device cannot rot unnoticed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
NUMBER = r"([\d.]+)"


def run(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def tiny_model(root: Path, **shape) -> str:
    """The benchmark's random model made here (``--model``), where the suite's process has imported transformers'
    model classes already: the script's own interpreter spent ~3 CPU-s importing them for its one model."""
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    return str(make_tiny_model(root, seed=0, num_heads=8, num_kv_heads=4, **shape))


@pytest.fixture(scope="module")
def expert_parallel_out(tmp_path_factory) -> str:
    """One run of ``expert_parallel.py`` prints all three tables (one interpreter importing torch, one tiny model,
    instead of one run for decode and bytes and another for eplb). The eplb table skews the router (of its copy of
    the model) after the decode and bytes tables ran, so they measure the unskewed model as before; 8 tokens a
    request (the eplb run's). The model is the script's own (its ``make_model``: a Qwen3 MoE of these options)."""
    model = tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", hidden_size=64, num_layers=2, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32)
    return run("expert_parallel.py", "--model", model, "--tables", "decode", "bytes", "eplb", "--sizes", "2",
               "--hidden", "64", "--intermediate", "32", "--experts", "8", "--top-k", "2", "--layers", "2",
               "--tokens", "8", "--concurrency", "2", "--batch-tokens", "16", "--hot", "1", "2", "--redundant", "2")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_prints_its_decode_and_bytes_tables(expert_parallel_out):
    out = expert_parallel_out
    decode = re.findall(rf"^(one rank|TP=2|EP=2)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.M)
    assert [row[0] for row in decode] == ["one rank", "TP=2", "EP=2"], out
    assert all(float(value) > 0 for row in decode for value in row[1:]), out
    rows = {name: float(value) for name, value, _ in re.findall(
        rf"^((?:TP|EP|DP)=2 all-(?:reduce|to-all))\s+{NUMBER}\s+{NUMBER}$", out, re.M)}
    assert set(rows) == {"TP=2 all-reduce", "EP=2 all-to-all", "EP=2 all-reduce", "DP=2 all-to-all"}, out
    # a ring all-reduce of a float32 hidden state (64 x 4 bytes) sends one hidden state a token per rank at 2 ranks
    assert rows["TP=2 all-reduce"] == rows["EP=2 all-reduce"] == 256.0
    assert rows["EP=2 all-to-all"] > rows["DP=2 all-to-all"] > 0  # DP: no all-gather of the combined chunks
    capacity = {name: float(value) for name, value, _ in re.findall(
        rf"^((?:EP|DP)=2 capacity)\s+{NUMBER}\s+{NUMBER}$", out, re.M)}
    # the fixed-capacity buffers move whole: more than the exact rows, never less
    assert capacity["EP=2 capacity"] > rows["EP=2 all-to-all"] and capacity["DP=2 capacity"] > rows["DP=2 all-to-all"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_parallel_prints_its_eplb_table(expert_parallel_out):
    """Two busy experts on one of two ranks: EPLB's row measures the load even, the index placement's does not."""
    out = expert_parallel_out
    rows = {name: [float(v) for v in values] for name, *values in re.findall(
        rf"^(EP=2(?: EPLB \+2)?)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.M)}
    assert set(rows) == {"EP=2", "EP=2 EPLB +2"}, out
    assert rows["EP=2"][4] < 0.75 and rows["EP=2 EPLB +2"][4] >= 0.9, out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_parallel_prints_a_row_per_layout(tmp_path):
    model = tiny_model(tmp_path / "dense", hidden_size=64, num_layers=3, intermediate_size=128)  # 3 layers: uneven
    out = run("pipeline_parallel.py", "--model", model, "--stages", "2", "--layers", "3", "--hidden", "64",
              "--intermediate", "128", "--tokens", "4", "--concurrency", "2")
    rows = re.findall(rf"^(one stage|PP=2 micro-batches [12])\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", out, re.M)
    assert [row[0] for row in rows] == ["one stage", "PP=2 micro-batches 1", "PP=2 micro-batches 2"], out
    assert all(float(wall) > 0 and float(cpu) > 0 for _, wall, _, cpu, _ in rows), out
