"""``benchmarks/offline_throughput.py`` compares the engine with ``transformers`` at its best (issue 84, item 6): on
the float32 checkpoint of a GGUF file's very weights, and at each of several batch sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from megatron_serve.model.hub import resolve_model
from tests.benchmarks.scripts import run_script, script_fixture
from tests.model.gguf_files import write_gguf

offline = script_fixture("offline", "offline_throughput_benchmark", "offline_throughput.py")


def test_transformers_reads_the_gguf_files_weights_from_its_float32_checkpoint(offline, tiny_llama, tmp_path,
                                                                                monkeypatch):
    """The checkpoint ``transformers`` loads holds each tensor as the engine dequantizes it (query and key rows
    in Hugging Face's order again), under the names ``transformers`` expects: nothing is left at its initial value."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = write_gguf(Path(tiny_llama), tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1)
    view = resolve_model(tmp_path / "tiny.gguf", tokenizer=False)

    checkpoint = offline.float32_checkpoint(view, tmp_path / "float32")

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], torch.from_numpy(expected[name])) for name in expected)


def test_each_batch_size_is_timed_and_the_best_named(tmp_path):
    result = run_script("offline_throughput.py", "--hidden-size", "64", "--layers", "2", "--requests", "3",
                        "--hf-modes", "static", "--hf-batch-size", "1,2", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("transformers generate")]
    assert [row.split(")")[0] for row in rows] == ["transformers generate (batch 1, static",
                                                   "transformers generate (batch 2, static"]
    assert "ratio to transformers static batch 2:" in result.stdout
    assert "ratio to transformers at its best:" in result.stdout


@pytest.mark.parametrize("sizes", ["0", "16,x", ""])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(sizes):
    result = run_script("offline_throughput.py", "--hf-batch-size", sizes)
    assert result.returncode == 2 and "--hf-batch-size: expected positive integers" in result.stderr
