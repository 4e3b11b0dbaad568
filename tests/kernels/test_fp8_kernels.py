"""FP8 kernels against their plain-PyTorch references: the number format, KV writes into an FP8 cache,
attention over it, FP8 weight GEMMs and FP8 experts.

Under ``TRITON_INTERPRET=1`` (no CUDA here) the interpreter runs Triton's e4m3 conversions and FP8
``tl.dot`` in software, so these check the kernels' arithmetic; the GPU-only paths (``torch._scaled_mm``
dispatch, CUDA graphs) are checked where a GPU is.
"""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import fp8, reference
from megatron_kernels import triton_ops as tri
from megatron_kernels.moe_weights import ExpertWeights
from megatron_kernels.paged_kv import PagedKV

from .test_kernels import DEVICE, _close, _cos_sin, _gen, _paged_setup, _qkv, _randn

E4M3 = torch.float8_e4m3fn


# -------------------------------------------------------------------------------------------- format


def test_quantize_roundtrip_error_is_within_half_an_fp8_step():
    w = torch.randn(48, 80, generator=_gen(1)) * 3
    for block in (None, (16, 32), (32, 48)):
        q, scale = fp8.quantize(w, block)
        assert q.dtype == E4M3 and scale.dtype == torch.float32
        assert scale.shape == fp8.scale_shape(48, 80, block)
        back = fp8.dequantize(q, scale, block, torch.float32)
        # e4m3 rounds to within 2^-4 of the value (3 mantissa bits), or half its subnormal step 2^-9
        assert ((back - w).abs() <= w.abs() * 2.0**-4 + fp8.expand_scales(scale, 48, 80, block) * 2.0**-10).all()
        # every row/tile reaches the top of the range: the scale is tight
        amax = fp8.dequantize(q.float().abs().to(E4M3), torch.ones_like(scale), block, torch.float32)
        assert amax.max() == fp8.FP8_MAX


def test_quantize_tiles_cover_ragged_edges():
    w = torch.zeros(20, 36)
    w[19, 35] = 7.0  # the last, partial tile
    q, scale = fp8.quantize(w, (8, 16))
    assert scale.shape == (3, 3)
    assert scale[2, 2] == pytest.approx(7.0 / 448) and (scale[:2] == fp8.MIN_SCALE).all()
    assert fp8.dequantize(q, scale, (8, 16), torch.float32)[19, 35] == 7.0


# ------------------------------------------------------------------------------------------- KV cache


def _fp8_cache(num_blocks, block_size, hkv, head_dim) -> PagedKV:
    k_cache = torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=E4M3, device=DEVICE)
    scales = torch.zeros(num_blocks, block_size, hkv, dtype=torch.float32, device=DEVICE)
    return PagedKV(k_cache, k_cache.clone(), scales, scales.clone())


def _dequantized(cache, scales):
    return cache.float() * scales.unsqueeze(-1)


@pytest.mark.parametrize(("hkv", "head_dim", "dtype"), [(2, 64, torch.float32), (1, 128, torch.bfloat16)])
def test_write_kv_cache_fp8(hkv, head_dim, dtype):
    tokens, num_blocks, block_size = 13, 6, 16
    _, key, value = _qkv(tokens, 4, hkv, head_dim, dtype, seed=21)
    key = key * 40  # keys far outside e4m3's unit range: the scale must carry them
    slots = torch.randperm(num_blocks * block_size, generator=_gen(22))[:tokens]
    slots[[3, 9]] = -1
    slots = slots.to(DEVICE)
    ref = _fp8_cache(num_blocks, block_size, hkv, head_dim)
    out = _fp8_cache(num_blocks, block_size, hkv, head_dim)
    reference.write_kv_cache(key, value, ref, slots)
    tri.write_kv_cache(key, value, out, slots)
    for a, b in zip(out, ref):
        assert torch.equal(a.float(), b.float())
    valid = slots >= 0
    stored = _dequantized(ref.k, ref.k_scales).view(-1, hkv, head_dim)[slots[valid]]
    _close(stored, key[valid].float(), dict(atol=0, rtol=2.0**-4))
    assert (ref.k_scales.view(-1, hkv)[slots[~valid]] == 0).all()  # padding wrote nothing


def test_rotary_fused_with_fp8_kv_write():
    tokens, hq, hkv, head_dim, block_size, num_blocks = 7, 8, 2, 128, 16, 3
    q, k, v = _qkv(tokens, hq, hkv, head_dim, torch.bfloat16, seed=23)
    cos, sin = _cos_sin(128, 96)  # partial rotary: the pass-through dims share the head's scale
    positions = torch.arange(40, 40 + tokens).to(DEVICE)
    slots = torch.tensor([5, 6, -1, 20, 21, 47, 0]).to(DEVICE)
    ref = _fp8_cache(num_blocks, block_size, hkv, head_dim)
    out = _fp8_cache(num_blocks, block_size, hkv, head_dim)
    ref_q, ref_k = reference.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, ref, slots)
    out_q, out_k = tri.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, out, slots)
    _close(out_q, ref_q, dict(atol=2e-2, rtol=2e-2))
    _close(out_k, ref_k, dict(atol=2e-2, rtol=2e-2))
    # scales from the rotated keys the op returned, values exactly as the reference stores them
    valid = slots >= 0
    torch.testing.assert_close(out.k_scales.view(-1, hkv)[slots[valid]],
                               out_k[valid].float().abs().amax(-1) / fp8.FP8_MAX, atol=0, rtol=1e-6)
    assert torch.equal(out.v.float(), ref.v.float()) and torch.equal(out.v_scales, ref.v_scales)


# ---------------------------------------------------------------------------------------------- attention


def _fp8_paged_setup(context_lens, hkv, head_dim, block_size, seed):
    """``_paged_setup``'s cache, quantized with one scale per slot and head (keys spread over a wide range)."""
    plain, tables, lens = _paged_setup(context_lens, hkv, head_dim, block_size, torch.float32, seed=seed)
    k_cache = plain.k * torch.linspace(0.01, 60, plain.k.shape[1], device=DEVICE)[None, :, None, None]
    k8, k_scales = fp8.quantize_heads(k_cache.flatten(0, 1))
    v8, v_scales = fp8.quantize_heads(plain.v.flatten(0, 1))
    shape = k_cache.shape
    return PagedKV(k8.view(shape), v8.view(shape), k_scales.view(shape[:3]), v_scales.view(shape[:3])), tables, lens


# Attention over dequantized values: only the order of the float32 sums differs from the reference.
FP8_ATTN_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize(("context_lens", "hkv", "group", "head_dim", "block_size", "dtype", "splits", "block_n"), [
    ((1, 17, 100), 2, 1, 64, 16, torch.float32, 1, None),
    ((33, 5), 1, 4, 128, 16, torch.bfloat16, 1, None),
    ((300, 1, 213), 1, 4, 64, 16, torch.float32, 4, 64),  # split-K
])
def test_paged_attention_decode_fp8_kv(context_lens, hkv, group, head_dim, block_size, dtype, splits, block_n):
    cache, tables, lens = _fp8_paged_setup(context_lens, hkv, head_dim, block_size, seed=24)
    q = _randn(len(context_lens), hkv * group, head_dim, dtype=dtype, seed=25)
    expected = reference.paged_attention_decode(q, cache, tables, lens, head_dim**-0.5)
    from megatron_kernels.triton_decode_attention import paged_attention_decode

    actual = paged_attention_decode(q, cache, tables, lens, head_dim**-0.5, num_splits=splits, block_n=block_n)
    _close(actual, expected, FP8_ATTN_TOL[dtype])
    # the reference reads the dequantized cache: the same as attending over those values in float32
    dequantized = PagedKV(_dequantized(cache.k, cache.k_scales), _dequantized(cache.v, cache.v_scales))
    dense = reference.paged_attention_decode(q, dequantized, tables, lens, head_dim**-0.5)
    _close(expected, dense, dict(atol=1e-6, rtol=1e-6))


@pytest.mark.parametrize(("seqs", "hkv", "group", "head_dim", "block_size", "dtype", "block_m", "block_n"), [
    (((37, 37), (100, 13), (1, 1)), 2, 1, 64, 16, torch.float32, None, None),
    (((50, 50), (130, 1)), 1, 4, 128, 16, torch.bfloat16, None, None),
    (((90, 37), (45, 45)), 1, 1, 64, 16, torch.float32, 32, 16),  # unmasked and diagonal key tiles
])
def test_paged_attention_prefill_fp8_kv(seqs, hkv, group, head_dim, block_size, dtype, block_m, block_n):
    context_lens = [c for c, _ in seqs]
    q_lens = [n for _, n in seqs]
    cache, tables, lens = _fp8_paged_setup(context_lens, hkv, head_dim, block_size, seed=26)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE)
    q = _randn(sum(q_lens), hkv * group, head_dim, dtype=dtype, seed=27)
    expected = reference.paged_attention_prefill(q, cache, tables, qsl, lens, head_dim**-0.5)
    from megatron_kernels.triton_prefill_attention import paged_attention_prefill

    actual = paged_attention_prefill(q, cache, tables, qsl, lens, head_dim**-0.5, block_m=block_m, block_n=block_n)
    _close(actual, expected, FP8_ATTN_TOL[dtype])


def test_attention_refuses_an_fp8_cache_without_both_scales():
    cache, tables, lens = _fp8_paged_setup((5,), 1, 64, 16, seed=28)
    q = _randn(1, 1, 64, seed=29)
    with pytest.raises(ValueError, match="both k_scales and v_scales"):
        tri.paged_attention_decode(q, cache._replace(v_scales=None), tables, lens, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        tri.paged_attention_decode(q, cache._replace(k_scales=cache.k_scales[:, :8], v_scales=cache.k_scales[:, :8]),
                                   tables, lens, 0.125)


def test_a_gpu_without_e4m3_attends_over_an_fp8_cache_through_the_reference_into_out(monkeypatch):
    """Before Ada, Triton has no e4m3 and the attention ops hand an FP8 cache to the reference: into the caller's
    ``out`` (the engine reads the rows it passed, never the returned tensor). Here no GPU is needed: the ops are
    told the device lacks e4m3, and ``out`` starts as NaN."""
    from megatron_kernels import triton_decode_attention, triton_prefill_attention

    for module in (triton_decode_attention, triton_prefill_attention):
        monkeypatch.setattr(module, "fp8_native", lambda device: False)
    cache, tables, lens = _fp8_paged_setup((5, 40), 1, 64, 16, seed=30)
    q = _randn(2, 2, 64, seed=31)
    starts = torch.arange(3, dtype=torch.int32).to(DEVICE)  # as prefill: one query row each, the last of its context
    for op, args in ((tri.paged_attention_decode, (lens,)), (tri.paged_attention_prefill, (starts, lens))):
        out = torch.full_like(q, float("nan"))
        assert op(q, cache, tables, *args, 0.125, out=out) is out, op.__module__
        assert torch.equal(out, getattr(reference, op.__name__)(q, cache, tables, *args, 0.125)), op.__module__


# ----------------------------------------------------------------------------------------------- GEMMs


def test_e4m3_rounding_matches_torch_on_every_boundary():
    """Activation quantization rounds to nearest even, carries included (the interpreter's own conversion
    does not: see ``_triton_utils.to_e4m3``)."""
    from megatron_kernels.triton_fp8_linear import quantize_rows

    codes = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # every finite positive e4m3 value
    midpoints = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([codes, midpoints, midpoints * (1 + 1e-6), midpoints * (1 - 1e-6)])
    values = torch.cat([values, -values]).reshape(1, -1).to(DEVICE)
    static = torch.ones(1, device=DEVICE)
    quantized, _ = quantize_rows(values, static_scale=static)
    assert torch.equal(quantized.float(), values.to(E4M3).float())


def _fp8_weight(n, k, block, seed):
    w = torch.randn(n, k, generator=_gen(seed)) * torch.linspace(0.05, 3, n)[:, None]
    q, scale = fp8.quantize(w, block)
    return q.to(DEVICE), scale.to(DEVICE)


def _w8a8_reference(x, weight, scale, block, bias=None, input_scale=None):
    """What an FP8 x FP8 GEMM computes: activations quantized as ``fp8.quantize_rows``, products in float32."""
    group = None if block is None else block[1]
    xq, xs = fp8.quantize_rows(x.reshape(-1, x.shape[-1]), group, input_scale)
    rows = xq.shape[0]
    xs = xs.expand(rows, -1)
    a = fp8.dequantize(xq, xs, None if group is None else (1, group), torch.float32)
    out = a @ fp8.dequantize(weight, scale, block, torch.float32).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


WEIGHT_CASES = [  # m, n, k, block, dtype, bias
    (1, 96, 160, None, torch.float32, False),
    (5, 72, 64, (16, 16), torch.bfloat16, True),
    (33, 40, 96, (32, 32), torch.float32, False),  # ragged last tile of rows
    (3, 64, 128, (16, 64), torch.float32, True),
    (2, 40, 96, (32, 48), torch.float32, False),  # scale blocks of 48 columns: tiles of 16, groups of 48
]


def _linear_inputs(m, n, k, block, dtype, bias, seed):
    """One of :data:`WEIGHT_CASES`: an FP8 weight ``[n, k]`` and its scales, the activations ``[m, k]`` and a bias
    or None, drawn from ``seed`` on."""
    weight, scale = _fp8_weight(n, k, block, seed=seed)
    x = _randn(m, k, dtype=dtype, seed=seed + 1)
    return weight, scale, x, _randn(n, dtype=dtype, seed=seed + 2) if bias else None


@pytest.mark.parametrize(("m", "n", "k", "block", "dtype", "bias"), WEIGHT_CASES)
def test_weight_only_fp8_linear_matches_reference(m, n, k, block, dtype, bias):
    from megatron_kernels.triton_fp8_linear import fp8_linear_weight_only

    weight, scale, x, b = _linear_inputs(m, n, k, block, dtype, bias, seed=31)
    expected = reference.fp8_linear(x, weight, scale, block, b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    _close(fp8_linear_weight_only(x, weight, scale, block, b), expected, tol)
    _close(fp8_linear_weight_only(x, weight, scale, block, b, split_k=3), expected, tol)  # partial sums


@pytest.mark.parametrize(("m", "n", "k", "block", "dtype", "bias"), WEIGHT_CASES)
def test_fp8_gemm_matches_quantized_reference(m, n, k, block, dtype, bias):
    from megatron_kernels.triton_fp8_linear import fp8_linear_fp8_gemm

    weight, scale, x, b = _linear_inputs(m, n, k, block, dtype, bias, seed=34)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    _close(fp8_linear_fp8_gemm(x, weight, scale, block, b), _w8a8_reference(x, weight, scale, block, b), tol)
    # and near the unquantized activations (what the reference path serves): e4m3's 2^-4 rounding, not a bug's
    actual = fp8_linear_fp8_gemm(x, weight, scale, block, b).float()
    unquantized = reference.fp8_linear(x, weight, scale, block, b).float()
    assert (actual - unquantized).norm() / unquantized.norm() < 0.03


@pytest.mark.parametrize("block", [None, (16, 16), (32, 32), (16, 64), (32, 48), (128, 128), (1, 24), (8, 8)])
def test_fp8_gemm_tiles_compile_on_a_gpu(block):
    """The FP8 x FP8 GEMM's K tile against a GPU's ``tl.dot`` rule (32 for e4m3 operands, 16 for float16), which
    the interpreter does not check: a tile it picks must compile, and must hold one scale column."""
    from megatron_kernels._triton_utils import min_dot_k
    from megatron_kernels.triton_fp8_linear import _fp8_dot

    for k in (16, 64, 96, 4096):
        dot = _fp8_dot(k, block)
        if dot is None:  # the reference path serves
            assert block is not None and block[1] % 16
            continue
        block_k, dtype = dot
        assert block_k >= min_dot_k(dtype) and dtype in (fp8.FP8_DTYPE, torch.float16)
        assert block is None or block[1] % block_k == 0


def test_static_activation_scale_and_scaled_mm():
    """A checkpoint's calibrated input scale replaces the per-token one; ``torch._scaled_mm`` (on CPU here)
    computes the same as the Triton FP8 GEMM for per-row weight scales."""
    from megatron_kernels.triton_fp8_linear import fp8_linear_fp8_gemm, fp8_linear_scaled_mm

    weight, scale = _fp8_weight(48, 64, None, seed=37)
    x = _randn(2, 9, 64, seed=38)
    static = torch.tensor([x.abs().max().item() / 448], device=DEVICE)
    expected = _w8a8_reference(x, weight, scale, None, input_scale=static)
    _close(fp8_linear_fp8_gemm(x, weight, scale, None, input_scale=static), expected, dict(atol=1e-3, rtol=1e-3))
    _scaled_mm_close(fp8_linear_scaled_mm(x, weight, scale, input_scale=static), x, weight, scale, static)
    _scaled_mm_close(fp8_linear_scaled_mm(x, weight, scale), x, weight, scale)


def _scaled_mm_close(actual, x, weight, scale, input_scale=None):
    """``torch._scaled_mm`` against the float32 products of the quantized operands.

    On CPU it sums in float32 as the reference does. cuBLASLt on Hopper adds FP8 tensor-core products in a
    narrower accumulator (about 14 bits kept, DeepSeek-V3 report sec. 3.3.2) before promoting to float32: an
    error of up to a few 2^-14 of the sum of the products' magnitudes (a GPU run: 0.0033 where that sum
    was 97), so there each element is allowed 2^-12 of its own sum besides the CPU's relative 1e-3.
    """
    expected = _w8a8_reference(x, weight, scale, None, input_scale=input_scale)
    if DEVICE == "cpu":
        _close(actual, expected, dict(atol=1e-3, rtol=1e-3))
        return
    # |A| @ |W|^T: quantization commutes with |.| (symmetric rounding, the same per-row scales)
    magnitude = _w8a8_reference(x.abs(), weight.float().abs().to(E4M3), scale, None, input_scale=input_scale)
    error = (actual.float() - expected.float()).abs()
    assert (error <= 1e-3 * expected.float().abs() + 2.0**-12 * magnitude.float()).all(), error.max()


def test_fp8_linear_dispatch_by_rows():
    """Few rows take the weight-only GEMM (exactly the reference's arithmetic); many the FP8 x FP8 one."""
    from megatron_kernels import triton_fp8_linear as lin

    weight, scale = _fp8_weight(32, 64, (16, 16), seed=39)
    few = _randn(lin.WEIGHT_ONLY_MAX_ROWS, 64, seed=40)
    many = _randn(lin.WEIGHT_ONLY_MAX_ROWS + 1, 64, seed=41)
    _close(tri.fp8_linear(few, weight, scale, (16, 16)), reference.fp8_linear(few, weight, scale, (16, 16)),
           dict(atol=1e-4, rtol=1e-4))
    _close(tri.fp8_linear(many, weight, scale, (16, 16)), _w8a8_reference(many, weight, scale, (16, 16)),
           dict(atol=1e-3, rtol=1e-3))


def test_fp8_linear_refuses_scales_that_do_not_fit():
    weight, scale = _fp8_weight(32, 64, (16, 16), seed=42)
    x = _randn(2, 64, seed=43)
    with pytest.raises(ValueError, match="do not fit"):
        tri.fp8_linear(x, weight, scale, (32, 16))
    with pytest.raises(ValueError, match="do not fit"):
        tri.fp8_linear(x, weight, scale[:, :1], None)


# ------------------------------------------------------------------------------------------------ experts


@pytest.mark.parametrize(("tokens", "hidden", "intermediate", "experts", "top_k", "block", "dtype"), [
    (7, 64, 32, 4, 2, None, torch.float32),
    (5, 64, 32, 8, 2, (16, 16), torch.float32),
    (3, 64, 64, 4, 1, (32, 32), torch.bfloat16),
])
def test_fused_moe_fp8_experts(tokens, hidden, intermediate, experts, top_k, block, dtype):
    from .test_fused_moe import _inputs

    x, plain, weights, ids = _inputs(tokens, hidden, intermediate, experts, top_k, torch.float32, seed=44)
    w13_8, w13_scale = fp8.quantize(plain.w13, block)
    w2_8, w2_scale = fp8.quantize(plain.w2, block)
    x = x.to(dtype)
    moe = ExpertWeights(w13_8, w2_8, w13_scale, w2_scale, block)
    expected = reference.fused_moe(x, moe, weights, ids)
    # the reference on FP8 experts is the reference on the dequantized experts
    dense = reference.fused_moe(x, ExpertWeights(fp8.dequantize(w13_8, w13_scale, block, dtype),
                                                 fp8.dequantize(w2_8, w2_scale, block, dtype)), weights, ids)
    assert torch.equal(expected, dense)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    _close(tri.fused_moe(x, moe, weights, ids), expected, tol)
