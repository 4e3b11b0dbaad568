"""Mixture-of-experts MLP in Triton: tokens sorted by expert, one grouped GEMM per projection.

The ``T * k`` (token, expert) pairs are sorted by expert and each expert's run is padded to a whole
number of ``BLOCK_M`` rows (:func:`align_by_expert`, plain tensor ops with no host sync, so a decode
step that contains it can be captured in a CUDA graph). Every program of the grouped GEMM serves one
``BLOCK_M`` block, which belongs to exactly one expert, times one ``BLOCK_N`` column tile:

1. gate/up: rows gathered from ``hidden`` (row ``id // k``) times ``w13[expert]`` -> intermediate, in sorted order;
2. SiLU-and-multiply on the intermediate (the dense MLP's kernel);
3. down: intermediate rows times ``w2[expert]``, scaled by the router weight and written to the pair's
   own row, then summed over ``k`` in float32.

Padding rows carry the sentinel id ``T * k``: they load zeros and store nothing. The grid is sized
by the shape-only bound ``T * k + min(E + 1, T * k) * (BLOCK_M - 1)`` rows; blocks past the real end
belong to expert -1 and return at once. There is no loop over experts anywhere.

A negative expert id is no expert (vLLM's ``expert_map`` convention): the expert-parallel dispatchers' fixed-capacity
buffers (``model.capacity_dispatcher``) and DeepEP's layouts fill their unused rows with -1, and the row count must
not depend on how many are used, so that a step can be captured. Those pairs sort into blocks of their own (expert
-2), which compute nothing and write zeros as the pairs' outputs.

FP8 experts (``w13_scale``/``w2_scale`` given) are read as e4m3 and widened in registers, their scales
applied to the products per ``BLOCK_K`` step (block-wise) or once per output column (per row); the
activations stay unquantized, as in the dense weight-only GEMM: a decode step's expert GEMMs are
bound by the weight bytes, which FP8 halves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._triton_utils import MIN_DOT_K, fp8_native, interpreted, last_dim_contiguous, next_pow2
from .fp8 import Block
from .moe_weights import ExpertWeights
from .triton_activation import silu_and_mul


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr, b_scale_ptr,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bse, stride_bsn,
    TOP_K: tl.constexpr,
    GATHER_A: tl.constexpr,
    SCATTER_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    B_FP8: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    """``C[rows] = A[rows] @ B[expert]^T`` for one block of sorted (token, expert) pairs.

    ``GATHER_A``: A rows are tokens (pair id // TOP_K), else A rows are the sorted positions themselves.
    ``SCATTER_C``: C rows are pair ids, scaled by the pair's router weight, else sorted positions.
    """
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    positions = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if expert == -2:  # pairs of no expert: their outputs are zero
        if SCATTER_C:
            ids = tl.load(sorted_ids_ptr + positions)
            tl.store(c_ptr + ids.to(tl.int64)[:, None] * stride_cm + cols[None, :],
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                     mask=(ids < num_pairs)[:, None] & col_mask[None, :])
        return
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + positions)
    valid = ids < num_pairs
    if GATHER_A:
        a_rows = (ids // TOP_K).to(tl.int64)
    else:
        a_rows = positions.to(tl.int64)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    scale_base = b_scale_ptr + expert.to(tl.int64) * stride_bse + (cols // SCALE_BN) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if FP32_DOT:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b.to(a.dtype))
        if B_FP8 and SCALE_BK < K:  # block-wise scales: BLOCK_K divides SCALE_BK, one scale column per step
            part = part * tl.load(scale_base + k0 // SCALE_BK, mask=col_mask, other=0.0)[None, :]
        acc += part
    if B_FP8 and SCALE_BK >= K:  # one scale per output row of the expert's weight
        acc = acc * tl.load(scale_base, mask=col_mask, other=0.0)[None, :]
    if SCATTER_C:
        acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
        c_rows = ids.to(tl.int64)
    else:
        c_rows = positions.to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_mask[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, expert) pairs by expert, each expert's run padded to whole ``block_m`` blocks.

    Returns ``sorted_ids`` (int32 pair ids ``token * k + slot``, padding = ``T * k``) and
    ``block_experts`` (int32 expert of each block, -2 for the blocks of pairs whose id is negative, which go
    last, -1 past the end). Shapes depend only on the input's shape, never on its values.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where(flat < 0, num_experts, flat)  # no expert: one bin more, after the experts
    bins = num_experts + 1
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(bins, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    destination = (padded_end - padded)[sorted_experts] + rank_in_expert
    num_blocks = triton.cdiv(pairs + min(bins, pairs) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids[destination] = order.to(torch.int32)
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts,
                                torch.where(block_experts == num_experts, -2, -1)).to(torch.int32)
    return sorted_ids, block_experts


def _tiles(x: torch.Tensor, pairs: int, num_experts: int, n: int, k: int, block: Block = None
           ) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``: whole-width tiles under the interpreter, register-sized ones on a GPU.

    On a GPU a block holds one expert's rows: with few rows per expert (decode) larger blocks are
    mostly padding, so 16 rows; prefill batches fill 64-row blocks. Block-wise FP8 scales need a
    ``BLOCK_K`` that divides the scale block's K.
    """
    if interpreted(x):
        block_m, block_n, block_k = 16, min(next_pow2(n), 256), min(next_pow2(k), 128)
    else:
        block_m = 16 if pairs <= 4 * num_experts else 64
        block_n, block_k = (64, 32) if x.dtype == torch.float32 else (128, 64)
    while block is not None and block[1] % block_k:
        block_k //= 2
    return block_m, block_n, block_k


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
                  sorted_ids: torch.Tensor, block_experts: torch.Tensor, num_pairs: int, top_k: int,
                  gather_a: bool, scatter_c: bool, block_m: int, block_n: int, block_k: int,
                  b_scale: torch.Tensor | None = None, block: Block = None) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    fp8 = b_scale is not None
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_experts, b_scale if fp8 else weights,
        num_pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        b_scale.stride(0) if fp8 else 0, b_scale.stride(1) if fp8 else 0,
        TOP_K=top_k, GATHER_A=gather_a, SCATTER_C=scatter_c,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=interpreted(a) or a.dtype == torch.float32,
        B_FP8=fp8,
        SCALE_BN=1 if block is None else block[0],
        SCALE_BK=k if block is None else block[1],
        num_warps=4, num_stages=2 if a.dtype == torch.float32 else 3,
    )


def fused_moe(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
    """Triton twin of :func:`megatron_kernels.reference.fused_moe`."""
    block = experts.block
    # A GPU's dot on 16-bit operands takes K tiles of 16 or more, and a tile must divide the scale block's K.
    if experts.fp8 and (not fp8_native(hidden.device) or block is not None and block[1] % MIN_DOT_K):
        return reference.fused_moe(hidden, experts, topk_weights, topk_ids)
    experts.check(hidden, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = experts.w13.shape
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    if pairs == 0:
        return hidden.new_zeros((num_tokens, hidden_size))
    hidden, w13, w2 = (last_dim_contiguous(t) for t in (hidden, experts.w13, experts.w2))
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block_m, block_n, block_k = _tiles(hidden, pairs, num_experts, two_i, hidden_size, block)
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    # Padding rows are never read; zeroed under the interpreter, whose numpy warns about garbage NaNs.
    gate_up = (torch.zeros if interpreted(hidden) else torch.empty)(
        (sorted_ids.shape[0], two_i), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, weights, sorted_ids, block_experts, pairs, top_k,
                  gather_a=True, scatter_c=False, block_m=block_m, block_n=block_n, block_k=block_k,
                  b_scale=experts.w13_scale, block=block)
    activated = silu_and_mul(gate_up)
    _, block_n, block_k = _tiles(hidden, pairs, num_experts, hidden_size, two_i // 2, block)
    out = torch.empty((pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _grouped_gemm(activated, w2, out, weights, sorted_ids, block_experts, pairs, top_k,
                  gather_a=False, scatter_c=True, block_m=block_m, block_n=block_n, block_k=block_k,
                  b_scale=experts.w2_scale, block=block)
    return out.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
