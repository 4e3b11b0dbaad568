"""SiLU-and-multiply (SwiGLU) on a fused gate/up projection, in Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import interpreted, last_dim_contiguous, next_pow2, num_warps_for, tile_budget


@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_x, stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptrs = x_ptr + rows64 * stride_x + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the storage dtype before the product, as the eager reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference.silu_and_mul`: ``silu(x[..., :n]) * x[..., n:]``."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"last dimension must be even, got {width}")
    n = width // 2
    x2 = last_dim_contiguous(x).reshape(-1, width)
    n_rows = x2.shape[0]
    out = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
    if n_rows and n:
        # On a GPU, narrow column tiles spread even a single row over many SMs.
        block_n = min(next_pow2(n), tile_budget(x) if interpreted(x) else 1024)
        block_m = min(max(1, tile_budget(x) // block_n), next_pow2(n_rows))
        grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n, block_n))
        _silu_and_mul_kernel[grid](
            x2, out, n_rows, n, x2.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
        )
    return out.view(*x.shape[:-1], n)
