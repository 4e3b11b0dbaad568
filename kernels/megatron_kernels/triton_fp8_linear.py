"""Linear layers with FP8 weights: the GEMMs behind ``fp8_linear``, and the choice between them.

Where cuBLASLt's row-wise FP8 GEMM serves (per-row scales, bf16, Hopper and newer: ``_scaled_mm_fits``),
it serves every step. Elsewhere, two kinds of GEMM, picked by the number of rows ``M`` (tokens) of the step:

* **Weight-only** (``M <= WEIGHT_ONLY_MAX_ROWS``, decode): the FP8 weight tile is widened to the
  activations' dtype in registers, multiplied by the unquantized activations, and its scales applied
  to the products. Decode is bound by the bytes of the weights, and these are half of bf16's; the
  activations are never quantized, so the result is the reference path's (:func:`reference.fp8_linear`)
  up to summation order. With few output tiles the K dimension is split across programs so that a
  batch-1 GEMV still fills the GPU.
* **FP8 x FP8** (larger ``M``, prefill and big decode batches, compute-bound): the activations are
  quantized per token (per token and ``block_k`` group for block-wise weights) by
  :func:`quantize_rows`, and the product runs on FP8 tensor cores at twice bf16's rate. Per-row
  weight scales go to ``torch._scaled_mm`` (cuBLASLt's row-wise scaled GEMM, Hopper and newer);
  block-wise scales, and GPUs or shapes cuBLASLt refuses, go to the Triton kernel here, which applies
  both sides' scales per ``BLOCK_K`` step. FP8 tensor cores take K tiles of 32 or more
  (:func:`~megatron_kernels._triton_utils.min_dot_k`): scale blocks of 16 columns widen their e4m3 tiles
  to float16 for the dot, and scale blocks whose columns no tile of 16 divides take the reference path.

``benchmarks/fp8.py gemm`` times the weight-only kernel, ``torch._scaled_mm`` and the Triton FP8 x FP8
kernel against bf16 on the 8B shapes. On an H200 (eager calls) ``torch._scaled_mm`` beat the weight-only
kernel on every projection at 16 and 64 rows (1.1-5x) and on three of four at 1 row, and the Triton
FP8 x FP8 kernel at every row count; hence its place first. Both Triton kernels were slower than bf16
at every size there (the FP8 x FP8 one 17-98x), which is still to be worked on.
On GPUs without FP8 support the reference path serves (:func:`megatron_kernels._triton_utils.fp8_native`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import capability, fp8_native, interpreted, min_dot_k, next_pow2, sm_count, tl_dtype, to_e4m3
from .fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Block, scale_shape

WEIGHT_ONLY_MAX_ROWS = 64  # memory-bound below: an 8B layer at 64 rows does 128 FLOP per weight byte, H100 ~295
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_MAX_SPLIT_K = 16


@triton.jit(do_not_specialize=["M", "k_per_split", "stride_split"])
def _scaled_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om, stride_split,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROWWISE: tl.constexpr,
    A_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``out[split] = A[:, ks] @ (W[:, ks] * w_scale)^T`` over this program's share ``ks`` of K.

    ``A_FP8``: A is e4m3 too, with its own scales (per row, or per ``SCALE_BK`` group of a row), and the
    products run on FP8 tensor cores; else A is in the compute dtype and W is widened to it (weight-only).
    ``DOT_DTYPE``: what both operands are in for ``tl.dot`` (e4m3 as they are, float16 holding e4m3 exactly,
    the compute dtype, or float32 at IEEE precision).
    ``ROWWISE``: one scale per weight row (and per A row), applied once at the end; else the scales of
    the ``SCALE_BN`` x ``SCALE_BK`` block of each ``BLOCK_K`` step (BLOCK_K divides SCALE_BK).
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_DTYPE == tl.float32:
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)))
        if not ROWWISE:
            part = part * tl.load(w_scale_ptr + (cols // SCALE_BN) * stride_wsn + k0 // SCALE_BK, mask=col_mask,
                                  other=0.0)[None, :]
            if A_FP8:
                part = part * tl.load(a_scale_ptr + rows * stride_asm + k0 // SCALE_BK, mask=row_mask,
                                      other=0.0)[:, None]
        acc += part
    if ROWWISE:
        acc = acc * tl.load(w_scale_ptr + cols * stride_wsn, mask=col_mask, other=0.0)[None, :]
        if A_FP8:
            acc = acc * tl.load(a_scale_ptr + rows * stride_asm, mask=row_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_split + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, static_scale_ptr,
    M, K,
    stride_xm, stride_om, stride_sm,
    GROUP: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    STATIC: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr,
):
    """One ``GROUP``-wide column group of ``BLOCK_M`` rows to e4m3, with its scale per row (``WIDTH``: ``GROUP``
    rounded up to a power of two, the tile's width)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    offsets = tl.arange(0, WIDTH)
    cols = group * GROUP + offsets
    mask = (rows < M)[:, None] & ((cols < K) & (offsets < GROUP))[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(static_scale_ptr)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / _FP8_MAX, _MIN_SCALE)
        tl.store(scale_ptr + rows.to(tl.int64) * stride_sm + group, scale, mask=rows < M)
    q = to_e4m3(tl.clamp(x / scale[:, None], -_FP8_MAX, _FP8_MAX), SOFTWARE_ROUNDING)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], q, mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Block) -> None:
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE or weight.stride(-1) != 1:
        raise ValueError(f"FP8 weights must be contiguous {FP8_DTYPE}, got {weight.dtype}")
    want = scale_shape(n, k, block)
    if tuple(weight_scale.shape) != want or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight scales {tuple(weight_scale.shape)} {weight_scale.dtype} do not fit weight "
                         f"{tuple(weight.shape)} with block {block}: want {want} float32")


def _k_step(k: int, block: Block, limit: int) -> int:
    """The K tile: a power of two up to ``limit`` that divides the scale block's K (one scale per step)."""
    step = min(limit, next_pow2(k))
    if block is not None:
        while block[1] % step:
            step //= 2
    return max(step, 16)


def _fp8_dot(k: int, block: Block) -> tuple[int, torch.dtype] | None:
    """The FP8 x FP8 GEMM's K tile and the dtype its ``tl.dot`` takes, or None where no tile of 16 or more
    columns divides the scale block's (then the reference path serves).

    FP8 tensor cores take K tiles of 32 or more. Per-row scales take any tile (columns past K are masked);
    a scale block of 16 columns gets tiles of 16 whose e4m3 operands are widened to float16, which holds
    every e4m3 value exactly: the same products, summed in float32, on 16-bit tensor cores.
    """
    step = _k_step(k, block, 128)
    fp8_k = min_dot_k(FP8_DTYPE)
    if block is None:
        return max(step, fp8_k), FP8_DTYPE
    if block[1] % step:
        return None
    return step, FP8_DTYPE if step >= fp8_k else torch.float16


def fp8_linear_weight_only(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Block,
                           bias: torch.Tensor | None = None, *, split_k: int | None = None) -> torch.Tensor:
    """``x @ (W * scale)^T + bias`` with the weight widened in registers (the decode GEMM)."""
    _check(x, weight, weight_scale, block)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cpu = interpreted(x)
    block_m = min(max(next_pow2(m), 16), 64)
    block_n = min(next_pow2(n), 128) if cpu else 64
    block_k = _k_step(k, block, 128)
    if block is not None and block[1] % block_k:
        return reference.fp8_linear(x, weight, weight_scale, block, bias)
    fp32_dot = cpu or x.dtype == torch.float32
    # a GPU's dot is in x's dtype: check the tile against it here too, where the interpreter would take any
    assert block_k >= min_dot_k(x.dtype), (block_k, x.dtype)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        want = 1 if cpu else triton.cdiv(2 * sm_count(x.device), tiles)
        split_k = max(1, min(want, triton.cdiv(k, block_k), _MAX_SPLIT_K))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _scaled_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
        x2, weight_scale, weight, weight_scale, bias if bias is not None and split_k == 1 else weight_scale, target,
        m, n, k, k_per_split,
        x2.stride(0), 0, weight.stride(0), weight_scale.stride(0), n, m * n,
        SCALE_BN=1 if block is None else block[0],
        SCALE_BK=k if block is None else block[1],
        ROWWISE=block is None,
        A_FP8=False,
        HAS_BIAS=bias is not None and split_k == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=tl.float32 if fp32_dot else tl_dtype(x.dtype),
        num_warps=4, num_stages=4 if not cpu else 1,
    )
    if split_k > 1:
        summed = target.sum(0)
        out = (summed if bias is None else summed + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], n)


def quantize_rows(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`megatron_kernels.fp8.quantize_rows` (``x`` ``[M, K]``)."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    group = k if group is None else group
    quantized = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    static = static_scale is not None
    scales = (static_scale.float().reshape(1, 1) if static
              else torch.empty((m, -(-k // group)), dtype=torch.float32, device=x.device))
    if m == 0:
        return quantized, scales
    width = next_pow2(group)
    block_m = max(1, min(next_pow2(m), (1 << 14) // width))
    _quantize_rows_kernel[(triton.cdiv(m, block_m), triton.cdiv(k, group))](
        x, quantized, scales, scales,
        m, k,
        x.stride(0), quantized.stride(0), 0 if static else scales.stride(0),
        GROUP=group, WIDTH=width, BLOCK_M=block_m, STATIC=static, SOFTWARE_ROUNDING=interpreted(x),
        num_warps=4,
    )
    return quantized, scales


def fp8_linear_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Block,
                        bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` (per token, per ``block_k`` group for block-wise weights, or the static scale), then
    the FP8 x FP8 Triton GEMM."""
    _check(x, weight, weight_scale, block)
    if input_scale is not None and block is not None:
        raise ValueError("a static activation scale goes with per-row weight scales, not block-wise ones")
    n, k = weight.shape
    dot = _fp8_dot(k, block)
    if dot is None:
        return reference.fp8_linear(x, weight, weight_scale, block, bias)
    block_k, dot_dtype = dot
    assert block_k >= min_dot_k(dot_dtype), (block_k, dot_dtype)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    a, a_scale = quantize_rows(x2, None if block is None else block[1], input_scale)
    if input_scale is not None:
        a_scale = a_scale.expand(m, 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cpu = interpreted(x)
    block_m = min(max(next_pow2(m), 16), 64 if cpu else 128)
    block_n = min(next_pow2(n), 128)
    _scaled_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), 1)](
        a, a_scale, weight, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, k,
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), 0,
        SCALE_BN=1 if block is None else block[0],
        SCALE_BK=k if block is None else block[1],
        ROWWISE=block is None,
        A_FP8=True,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=tl.float8e4nv if dot_dtype == FP8_DTYPE else tl_dtype(dot_dtype),
        num_warps=8 if block_m >= 128 else 4, num_stages=3 if not cpu else 1,
    )
    return out.view(*x.shape[:-1], n)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row weight scales through ``torch._scaled_mm`` with per-token activation scales (cuBLASLt on a GPU)."""
    _check(x, weight, weight_scale, None)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    a, a_scale = quantize_rows(x2, None, input_scale)
    out = torch._scaled_mm(a, weight.t(), scale_a=a_scale.expand(x2.shape[0], 1).contiguous(),
                           scale_b=weight_scale.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, block: Block) -> bool:
    """cuBLASLt's row-wise FP8 GEMM: Hopper or newer, dimensions multiples of 16, a bf16 result."""
    n, k = weight.shape
    return (block is None and x.device.type == "cuda" and capability(x.device) >= (9, 0)
            and n % 16 == 0 and k % 16 == 0 and x.dtype == torch.bfloat16)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Block,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton-backend twin of :func:`megatron_kernels.reference.fp8_linear` (see the module docstring)."""
    if not fp8_native(x.device):
        return reference.fp8_linear(x, weight, weight_scale, block, bias, input_scale)
    if _scaled_mm_fits(x, weight, block):
        return fp8_linear_scaled_mm(x, weight, weight_scale, bias, input_scale)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return fp8_linear_weight_only(x, weight, weight_scale, block, bias)
    return fp8_linear_fp8_gemm(x, weight, weight_scale, block, bias, input_scale)
