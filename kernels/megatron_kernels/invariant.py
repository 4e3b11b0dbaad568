"""Batch-invariant arithmetic: ops whose result for one row does not depend on the other rows.

A CPU (or GPU) library picks its algorithm by the shape it is given: ``torch.mm`` of one row is a
matrix-vector product, of seven rows a blocked GEMM, and the two round differently (on this 2-core
AVX-512 machine 1 row and 2 rows already differ in float32). Elementwise functions differ too: a
vectorized loop leaves a tail of a tensor to a scalar loop, and PyTorch's scalar ``silu`` rounds
differently from its vector one (767 of 20,000 float32 values differ). A token's log prob then
depends on how many other tokens share its step. The ops here remove every such dependence:

* :func:`linear`: rows padded to a multiple of :func:`row_tile` rows, so no row meets the library's
  one-row (matrix-vector) path, and a row's GEMM arithmetic does not change with the batch;
* :func:`silu`, :func:`sigmoid`, :func:`exp`, :func:`cos`, :func:`sin`: the tensor is flattened, padded to whole
  vectors and cut into pieces no larger than one thread's share, so every element takes the
  vector path, and vector lanes do not interact;
* the attention (:mod:`.invariant_attention`): keys reduced in blocks of :data:`KEY_BLOCK` from position
  0 by GEMMs of a fixed shape per block, so a query's output depends only on its own position and its
  sequence's keys: prefill, decode, a prefix-cache hit and any chunking give the same bits.

Row-wise kernels PyTorch already runs one row at a time (``softmax``, ``log_softmax``, ``mean`` over
the last dimension) and correctly rounded elementwise ops (``+``, ``*``, ``rsqrt``, casts) need
nothing.

The engine calls these functions directly when started with ``--batch-invariant``;
:class:`InvariantMode` routes a trainer's ``F.linear``, ``F.silu`` and ``torch.cos``/``sin``/``exp``
here (``megatron_serve.invariant.batch_invariant``). Only ``torch`` is imported (and this package's torch-only
:mod:`.moe_weights`).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .moe_weights import ExpertWeights

SAFE_ROW_TILE = 16
"""Rows per GEMM tile that every CPU probed so far holds: from 16 rows up MKL 2024.2 (float32 and bfloat16,
AVX-512, 1 and 2 threads) computed a row the same way whatever the row count and the row's place, on an
Intel CPU (which took other paths below 16 rows: 8 rows already rounded otherwise) and on an AMD EPYC."""

ROW_TILE_VARIABLE = "MEGATRON_INVARIANT_ROW_TILE"
"""Sets the row tile instead of the probe (a multiple of 4): for a CPU the probe misjudges, or to pin it."""

_row_tile: int | None = None

ISA_VARIABLE, NO_AMX = "ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"
"""oneDNN's cap on the instructions it uses, and the cap the mode sets: below AMX. On a CPU with AMX (Intel Sapphire
Rapids) oneDNN's bfloat16 GEMMs rounded a row differently with the row count at every tile up to 64; capped at
AVX-512's bfloat16 instructions they keep a row's bits from 4 rows (float32 GEMMs use no AMX either way). Only
bfloat16 and int8 GEMMs of a process that runs the mode lose AMX's speed."""


def row_tile() -> int:
    """The rows every invariant GEMM on the CPU pads to a multiple of (a linear's rows, an expert's rows, an
    attention GEMM's query rows): a row's bits then do not depend on the other rows or their count.

    Which counts keep a row's bits is the math library's choice per CPU: the AMD EPYC kept them for every
    multiple of 4 (1-3 rows, and on 2 threads 5-7 and 9-11, take other paths), the Intel CPU only from 16.
    So it is probed once per process at first use, at the thread count then set (:func:`_rows_hold`: a few
    dozen small GEMMs, about 0.1 s): 4, else 8, else :data:`SAFE_ROW_TILE`. Any tile the probe accepts gives
    the same bits, so an engine and a trainer on one machine agree whichever each settles on. 4 instead of
    16 pads a decode step, an expert's few rows and a decode row's attention GEMMs less (an MoE layer of 32
    decode tokens, 8 experts: 334 -> 274 us on the EPYC; the cost benchmark's mode 0.66-0.83x -> 0.78-0.92x
    of the default)."""
    global _row_tile
    if _row_tile is None:
        _row_tile = _settle_row_tile()
    return _row_tile


def _settle_row_tile() -> int:
    os.environ.setdefault(ISA_VARIABLE, NO_AMX)  # read by oneDNN once, at its first GEMM in the process
    forced = os.environ.get(ROW_TILE_VARIABLE)
    if forced is not None:
        if not forced.isdigit() or int(forced) <= 0 or int(forced) % 4:
            raise ValueError(f"{ROW_TILE_VARIABLE}={forced!r}: must be a positive multiple of 4")
        return int(forced)
    tile = next((tile for tile in (4, 8, SAFE_ROW_TILE) if _rows_hold(tile)), None)
    if tile is None:
        raise RuntimeError(f"batch-invariant mode: this CPU's GEMMs keep no row's bits at any row tile up to "
                           f"{SAFE_ROW_TILE} (bfloat16 on AMX tiles does not): start the process with "
                           f"{ISA_VARIABLE}={NO_AMX}, which the mode sets itself only where no GEMM ran before it")
    return tile


def _rows_hold(tile: int) -> bool:
    """Whether a row of the GEMMs the mode runs has the same bits for every row count that is a multiple of
    ``tile`` up to 48, here: linears (float32, bfloat16) and the attention's ``[M, D] x [D, 32]`` (transposed
    keys) and ``[M, 32] x [32, D]`` products (float32), one GEMM alone and a batch of 3.
    ``megatron_kernels.invariant_probe`` checks the model's own shapes at an engine's start."""
    generator = torch.Generator().manual_seed(0)
    counts = range(tile, 49, tile)
    for dtype in (torch.float32, torch.bfloat16):
        for inner, outer in ((64, 16), (256, 256), (683, 257)):
            x = torch.randn((48, inner), generator=generator).to(dtype)
            weight = torch.randn((outer, inner), generator=generator).to(dtype)
            reference = torch.mm(x, weight.t())
            if not all(torch.equal(torch.mm(x[:rows], weight.t()), reference[:rows]) for rows in counts):
                return False
    for dim in (16, 64, 128):
        rows = torch.randn((3, 48, dim), generator=generator)
        keys = torch.randn((3, KEY_BLOCK, dim), generator=generator).transpose(1, 2)
        weights = torch.randn((3, 48, KEY_BLOCK), generator=generator)
        values = torch.randn((3, KEY_BLOCK, dim), generator=generator)
        for left, right in ((rows, keys), (weights, values)):
            reference = torch.bmm(left, right)
            for count in counts:
                if not (torch.equal(torch.bmm(left[:, :count], right), reference[:, :count])
                        and torch.equal(torch.bmm(left[:1, :count], right[:1]), reference[:1, :count])):
                    return False
    return True


KEY_BLOCK = 32
"""Keys per attention block: every query reduces its keys in blocks of this many from position 0."""

_VECTOR = 64
"""Elements of two AVX-512 registers of bfloat16: a multiple of every vector loop's stride."""

_FLOAT_STEP = 32
"""float32 elements of one step of PyTorch's vector loop (two AVX-512 registers): a contiguous run of whole
steps leaves nothing to the scalar tail."""

_PIECE = 32768
"""PyTorch's grain: an elementwise op of at most this many elements runs on one thread, so no thread
boundary can cut a vector loop short."""

def _gpu_kernels(x: torch.Tensor):
    """The Triton twins for a CUDA tensor (fixed tiles per weight shape, one row per norm program), else
    ``None``: on CPU the PyTorch ops here are the invariant ones. Imported on first GPU use, so a trainer
    on CPU needs no ``triton``."""
    if not x.is_cuda:
        return None
    from . import triton_invariant_linear, triton_invariant_norm  # noqa: PLC0415 - GPU only, needs triton
    return triton_invariant_linear, triton_invariant_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, the rows padded to a multiple of :func:`row_tile` (differentiable: a trainer's
    backward runs through it); on CUDA the Triton kernel of ``triton_invariant_linear``."""
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[0].invariant_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    count, tile = rows.shape[0], row_tile()
    if count % tile:
        rows = F.pad(rows, (0, 0, 0, tile - count % tile))
    out = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
    return out[:count].view(*x.shape[:-1], weight.shape[0])


def lanewise(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``function(x)`` for an elementwise ``function``, every element through the vector loop."""
    count = x.numel()
    size = -(-count // _VECTOR) * _VECTOR
    if size == count and x.is_contiguous():
        flat = x.view(-1)
    else:  # one copy, from a strided x too (SwiGLU's gate half)
        flat = x.new_empty(size)
        flat[:count].view(x.shape).copy_(x)
        if size > count:
            flat[count:] = 0
    if size <= _PIECE or torch.get_num_threads() == 1:  # one thread runs it all: no boundary inside a vector
        out = function(flat)
    else:
        out = torch.empty_like(flat)
        for start in range(0, size, _PIECE):
            out[start:start + _PIECE] = function(flat[start:start + _PIECE])
    return out[:count].view(x.shape)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """:func:`exp` in place on float32 rows of whole vector steps (the engine's attention weights, a view of a
    larger tensor): the same kernel over the same vectors as :func:`exp`, so the same bits; on several
    threads in pieces of whole leading rows, each at most one thread's share."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.shape[-1] % _FLOAT_STEP:
        raise ValueError(f"exp_ needs float32 rows of whole {_FLOAT_STEP}-element steps, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    step = x.shape[0] if torch.get_num_threads() == 1 else max(1, _PIECE // max(1, x[0].numel()))
    for start in range(0, x.shape[0], step):
        part = x[start:start + step]
        torch.exp(part, out=part)
    return x


# The mode's elementwise functions: each one of torch's through :func:`lanewise`.
silu: Callable[[torch.Tensor], torch.Tensor] = functools.partial(lanewise, F.silu)
exp: Callable[[torch.Tensor], torch.Tensor] = functools.partial(lanewise, torch.exp)
cos: Callable[[torch.Tensor], torch.Tensor] = functools.partial(lanewise, torch.cos)
sin: Callable[[torch.Tensor], torch.Tensor] = functools.partial(lanewise, torch.sin)
sigmoid: Callable[[torch.Tensor], torch.Tensor] = functools.partial(lanewise, torch.sigmoid)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up tensor, as ``act(gate) * up`` of separate projections computes it. A small
    contiguous ``x`` (an expert's rows) goes through SiLU whole, up half included, rather than its gate half
    copied out (the same bits per element: one call less, 11 -> 7 us for 16 rows of 2 x 64)."""
    gate, up = x.chunk(2, dim=-1)
    if x.numel() <= _PIECE and x.is_contiguous() and not x.numel() % _VECTOR:
        return F.silu(x)[..., :gate.shape[-1]] * up
    return silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, op for op as ``transformers`` writes it (float32 statistics, cast, then the weight);
    on CUDA the one-row-per-program Triton kernel of ``triton_invariant_norm``."""
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[1].invariant_rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _gpu_kernels(x)
    if kernels is not None:
        return kernels[1].invariant_fused_add_rms_norm(x, residual, weight, eps)
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as ``transformers`` applies it: ``x * cos + rotate_half(x) * sin`` in ``x``'s dtype,
    ``cos_full``/``sin_full`` over the whole head dimension (both halves), already in that dtype."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_full + rotated_half * sin_full


def fused_moe(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
    """Mixture-of-experts SwiGLU as ``transformers``' expert loop computes it, with invariant GEMMs.

    Experts in ascending id order; each takes its tokens' rows through :func:`linear`'s GEMM (padded
    with repeats that no token reads), scales them by the router weight (in ``topk_weights``' dtype:
    Qwen-MoE routers round it to the model dtype, Mixtral's keeps float32), rounds to the model dtype
    and adds them into a zero-initialised output, so a token's sum runs over its experts in ascending
    id order whatever the other tokens are. A negative id is no expert: the pair adds nothing.

    Of FP8 experts only those the step routes to are dequantized (one rounding per element, the same bits
    whatever the batch), renumbered in ascending id order, so each token still sums its experts in that order.
    """
    experts.check(hidden, topk_weights, topk_ids)
    if experts.fp8:
        used = torch.unique(topk_ids[topk_ids >= 0])  # sorted
        topk_ids = torch.where(topk_ids >= 0, torch.searchsorted(used, topk_ids), -1)
        w13, w2 = experts.dequantized(used, hidden.dtype)
    else:
        w13, w2 = experts.w13, experts.w2
    top_k, num_experts = topk_ids.shape[1], w13.shape[0]
    flat = torch.where(topk_ids.reshape(-1) < 0, num_experts, topk_ids.reshape(-1))  # no expert: sorted last
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert: one sort, not a
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()[:num_experts]  # search per expert
    order = order[:sum(counts)]
    tokens = order // top_k
    # each expert's rows, then its first row repeated up to a multiple of row_tile() rows (a row's bits do not
    # depend on the rows beside it; the repeats are dropped): one gather, no padded copy per GEMM
    picked, real, spans, start, tile = [], [], [], 0, row_tile()
    for expert, count in enumerate(counts):
        if count:
            size = -(-count // tile) * tile
            spans.append((expert, len(picked), size))
            real += range(len(picked), len(picked) + count)
            picked += list(range(start, start + count)) + [start] * (size - count)
            start += count
    device = tokens.device
    rows = hidden[tokens[torch.tensor(picked, dtype=torch.long, device=device)]]
    down = hidden.new_empty((len(picked), hidden.shape[1]))
    for expert, at, size in spans:  # linear()'s GEMMs
        torch.mm(silu_and_mul(torch.mm(rows[at:at + size], w13[expert].t())), w2[expert].t(), out=down[at:at + size])
    real = torch.tensor(real, dtype=torch.long, device=device)
    scaled = (down[real] * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
    # One index_add_ per expert, in ascending id order: within one a token appears once, so even CUDA's atomic
    # adds meet no other row of the same token and a token's sum runs over its experts in that order. (One
    # index_add_ of every row adds them one after another on a CPU but in any order on a GPU.)
    out, begin = torch.zeros_like(hidden), 0
    for count in counts:
        if count:
            out.index_add_(0, tokens[begin:begin + count], scaled[begin:begin + count])
            begin += count
    return out


_OVERRIDES: dict[Callable, Callable] = {
    F.linear: linear,
    F.silu: lambda x, inplace=False: silu(x),
    torch.cos: cos,
    torch.Tensor.cos: cos,
    torch.sin: sin,
    torch.Tensor.sin: sin,
    torch.exp: exp,
    torch.Tensor.exp: exp,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
}


class InvariantMode(TorchFunctionMode):
    """Routes the ops of :data:`_OVERRIDES` (called the plain way, no ``out=``) to their invariant twins;
    inside the handler the mode is off, so the twins call the plain ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = _OVERRIDES.get(func)
        if replacement is not None and "out" not in kwargs:
            return replacement(*args, **kwargs)
        return func(*args, **kwargs)
