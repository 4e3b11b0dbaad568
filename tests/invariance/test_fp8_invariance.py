"""``--batch-invariant`` with FP8 weights: quantized at load (per-row scales) and from a block-wise FP8
checkpoint, dense and MoE, float32 and bfloat16, the target is bitwise the same alone and among 7 and 63
others, chunked and in the serial loop; the control: without the mode the batch changes float32 log probs."""

from __future__ import annotations

import pytest

from ..fp8_checkpoints import block_fp8_checkpoint
from .runs import Setup, differing, run_target

VARIANTS = [Setup(others=7), Setup(others=63), Setup(others=3, max_batch_tokens=16),
            Setup(others=7, async_scheduling=False)]


@pytest.fixture(scope="module")
def block_fp8(models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("block-fp8")
    return {arch: str(block_fp8_checkpoint(models[arch], root / arch, block=(16, 16))) for arch in ("llama",
                                                                                                      "qwen3_moe")}


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_moe", "float32")])
def test_fp8_weights_quantized_at_load_are_bitwise_the_same_in_every_batch(models, arch, dtype):
    alone = run_target(models[arch], dtype, True, Setup(quantization="fp8"))
    for setup in VARIANTS:
        setup.quantization = "fp8"
        run = run_target(models[arch], dtype, True, setup)
        assert (run.tokens, run.log_probs) == (alone.tokens, alone.log_probs), \
            f"{arch} {dtype}, {setup.describe()}: {differing(alone, run)}"


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_block_fp8_checkpoint_is_bitwise_the_same_in_every_batch(block_fp8, arch):
    alone = run_target(block_fp8[arch], "bfloat16", True, Setup())
    for setup in VARIANTS[:2]:
        run = run_target(block_fp8[arch], "bfloat16", True, setup)
        assert (run.tokens, run.log_probs) == (alone.tokens, alone.log_probs), \
            f"{arch}, {setup.describe()}: {differing(alone, run)}"


def test_without_the_mode_the_batch_changes_fp8_log_probs(models):
    alone = run_target(models["llama"], "float32", False, Setup(quantization="fp8"))
    changed = [setup.describe() for setup in (Setup(others=63, quantization="fp8"),
                                              Setup(others=3, max_batch_tokens=16, quantization="fp8"))
               if differing(run_target(models["llama"], "float32", False, setup).log_probs, alone.log_probs)]
    assert changed, "control: without the mode neither the batch nor the chunk changed the FP8 log probs"
