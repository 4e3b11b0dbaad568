"""Launch heuristics, and a GPU build of every kernel on machines that have no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kernels import (_triton_utils, triton_activation, triton_decode_attention, triton_fp8_linear,
                              triton_invariant_attention, triton_kv_cache, triton_moe, triton_norm,
                              triton_prefill_attention, triton_rotary)

# Integer arguments that change from one engine step to the next. Triton compiles a kernel variant per
# class of an integer's value (1, a multiple of 16, other) unless told not to: a new class met
# mid-serving cost a 1.8-2.2 s compile on an H100 (the prefill kernel's block-table stride).
PER_STEP_ARGUMENTS = [
    (triton_prefill_attention._prefill_kernel, {"num_seqs", "search_steps", "stride_bt"}),
    (triton_decode_attention._decode_kernel, {"stride_bt"}),
    (triton_invariant_attention._invariant_attention_kernel,
     {"num_decode", "num_chunks", "search_steps", "stride_dt", "stride_pt"}),
    (triton_norm._rms_norm_kernel, {"n_rows"}),
    (triton_activation._silu_and_mul_kernel, {"n_rows"}),
    (triton_kv_cache._write_kv_kernel, {"n_tokens"}),
    (triton_rotary._rotary_kernel, {"n_tokens"}),
    (triton_moe._grouped_gemm_kernel, {"num_pairs"}),
    (triton_fp8_linear._scaled_gemm_kernel, {"M", "k_per_split", "stride_split"}),
    (triton_fp8_linear._quantize_rows_kernel, {"M"}),
]


@pytest.mark.parametrize("elems", [1, 100, 512, 1500, 2560, 5120, 1 << 20])
def test_num_warps_is_a_power_of_two(elems):
    warps = _triton_utils.num_warps_for(elems)
    assert 1 <= warps <= 8 and warps & (warps - 1) == 0


def test_rows_per_program_fits_budget():
    x = torch.empty(0)
    for row_elems in (1, 64, 100, 4096, 1 << 20):
        for rows in (1, 7, 1000):
            n = _triton_utils.rows_per_program(x, row_elems, rows)
            assert n >= 1 and n & (n - 1) == 0
            assert n <= _triton_utils.next_pow2(rows)
            assert n == 1 or n * _triton_utils.next_pow2(row_elems) <= _triton_utils.tile_budget(x)


def test_decode_split_heuristic():
    def choose(seqs: int, kv_heads: int, context: int, block_n: int) -> int:
        return triton_decode_attention.split_count(seqs, kv_heads, context, block_n, sms=132)

    assert choose(1, 8, 8192, 64) == 32  # one sequence, long context: fill the GPU
    assert choose(1, 8, 256, 64) == 1  # short context: not worth a second kernel
    assert choose(64, 8, 8192, 64) == 1  # enough programs already
    for seqs in range(1, 40):
        splits = choose(seqs, 4, 4096, 64)
        assert splits & (splits - 1) == 0 and 1 <= splits <= 16


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel tests run natively on this GPU")
@pytest.mark.parametrize("capability", [90])  # the script takes 80 as well (A100)
def test_kernels_build_for_gpu(capability):
    """Every bf16 launch the wrappers make compiles to a cubin for Hopper (ptxas ships with triton).

    The script without ``--quick`` also builds the float32 variants (slow to compile: not here)."""
    script = Path(__file__).with_name("gpu_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(script), str(capability), "--quick"], env=env, capture_output=True,
                            text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failed" in result.stdout


@pytest.mark.parametrize("kernel, per_step", PER_STEP_ARGUMENTS, ids=lambda v: getattr(v, "__name__", ""))
def test_no_kernel_specializes_on_a_size_that_changes_between_steps(kernel, per_step):
    names, unspecialized = _specialization(kernel)
    assert per_step <= names
    assert per_step - unspecialized == set()


def _specialization(kernel) -> tuple[set[str], set[str]]:
    """A kernel's argument names, and those Triton is told not to specialize on (compiled or interpreted)."""
    if hasattr(kernel, "params"):  # compiled: triton.runtime.jit.JITFunction
        return {p.name for p in kernel.params}, {p.name for p in kernel.params if p.do_not_specialize}
    names = kernel.arg_names  # under TRITON_INTERPRET=1: the decorator's arguments as given
    return set(names), {names[a] if isinstance(a, int) else a for a in kernel.kwargs.get("do_not_specialize") or ()}
