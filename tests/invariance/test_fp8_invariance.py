"""``--batch-invariant`` with FP8 weights: quantized at load (per-row scales) and from a block-wise FP8
checkpoint, dense and MoE, float32 and bfloat16, the target is bitwise the same alone and among 7 and 63
others, chunked and in the serial loop; the control: without the mode a case that moves on the CPU at hand changes the
log probs."""

from __future__ import annotations

import platform

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


# The control's cases, each one that moved the target's FP8 log probs without the mode on some CPU: the batch and the
# chunk in float32 (where the control began), and, on an AMD EPYC where the C++ attention and oneDNN keep float32 rows
# apart whatever the batch, a request recomputed after preemption in float32 (its generated tokens' keys then come from
# a prefill forward instead of decode steps) and bfloat16 prefill in chunks of 16 (torch's flash kernel is tiled by
# the chunk).
CONTROL_CASES = [("float32", Setup(others=63, quantization="fp8")),
                 ("float32", Setup(others=3, max_batch_tokens=16, quantization="fp8")),
                 ("float32", Setup(others=7, num_kv_blocks=10, quantization="fp8")),
                 ("bfloat16", Setup(others=3, max_batch_tokens=16, quantization="fp8"))]


def cpu_name() -> str:
    """The CPU's model name, for a skip's reason (the cases that move depend on it)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "this CPU"


def test_without_the_mode_the_batch_changes_fp8_log_probs(models):
    """The control: the first of ``CONTROL_CASES`` that changes the target's log probs without the mode on the CPU at
    hand (a case that holds on one CPU and not another is no control); none moving is a skip that names the CPU."""
    alone: dict[str, list[float]] = {}
    for dtype, setup in CONTROL_CASES:
        if dtype not in alone:
            alone[dtype] = run_target(models["llama"], dtype, False, Setup(quantization="fp8")).log_probs
        if differing(run_target(models["llama"], dtype, False, setup).log_probs, alone[dtype]):
            return
    tried = "; ".join(f"{dtype}, {setup.describe()}" for dtype, setup in CONTROL_CASES)
    pytest.skip(f"control: on {cpu_name()} without the mode none of the cases changed the FP8 log probs ({tried}): "
                "nothing here shows the mode is needed")
