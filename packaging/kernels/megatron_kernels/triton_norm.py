"""RMSNorm and fused residual-add + RMSNorm in Triton (one pass over each row, fp32 statistics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import last_dim_contiguous, next_pow2, num_warps_for, rows_per_program, tl_dtype


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    n_rows, n_cols, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to its storage dtype first, as the reference normalises the stored sum.
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows64 * stride_s + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(variance + eps)
    normed = (x * rstd[:, None]).to(NORM_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = w[None, :] * normed
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    one_row_per_program: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (after adding ``residual`` when given) over the last dimension: ``(out, summed or None)``.
    ``one_row_per_program``: the batch-invariant launch (:mod:`.triton_invariant_norm`), whose warps depend on
    the hidden size alone; otherwise a program takes as many rows as fill it."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = last_dim_contiguous(x).reshape(-1, hidden)
    n_rows = x2.shape[0]
    weight = weight.contiguous()
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
        r2 = last_dim_contiguous(residual).reshape(-1, hidden)
        summed = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        norm_dtype = summed.dtype
    else:
        r2 = summed = x2  # unused by the kernel
        norm_dtype = x.dtype
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device)
    if n_rows:
        block_n = next_pow2(hidden)
        block_m = 1 if one_row_per_program else rows_per_program(x, block_n, n_rows)
        _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
            x2, r2, weight, out, summed,
            n_rows, hidden, float(eps),
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            HAS_RESIDUAL=residual is not None,
            NORM_DTYPE=tl_dtype(norm_dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps_for(block_m * block_n),
        )
    shape = x.shape
    if residual is None:
        return out.view(shape), None
    return out.view(shape), summed.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference.rms_norm`."""
    return launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`megatron_kernels.reference.fused_add_rms_norm`: ``(rms_norm(x + r), x + r)``."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    return launch_rms_norm(x, residual, weight, eps)
