"""Every Triton op against its plain-PyTorch reference.

On a machine without CUDA these run under ``TRITON_INTERPRET=1`` (see ``conftest.py``), which pays about
1.5 ms per program instance: shapes are chosen to cover odd lengths, partial blocks, GQA ratios 1/4/8
and head sizes 64/128 with few programs each.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_kernels import reference
from megatron_kernels import triton_ops as tri
from megatron_kernels.paged_kv import PagedKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# Attention on a GPU rounds probabilities to the value dtype before the P @ V product.
ATTN_TOL = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype, device=DEVICE)


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize(
    ("shape", "dtype", "weight_dtype"),
    [
        ((7, 100), torch.float32, None),
        ((3, 5, 64), torch.bfloat16, None),
        ((33, 128), torch.float16, None),
        ((4, 96), torch.bfloat16, torch.float32),
    ],
)
def test_rms_norm(shape, dtype, weight_dtype):
    x = _randn(*shape, dtype=dtype, seed=1)
    w = _randn(shape[-1], dtype=weight_dtype or dtype, seed=2, scale=0.5) + 1
    expected = reference.rms_norm(x, w, 1e-6)
    actual = tri.rms_norm(x, w, 1e-6)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    _close(actual, expected, TOL[dtype])


@pytest.mark.parametrize(("shape", "dtype"), [((7, 100), torch.float32), ((2, 9, 128), torch.bfloat16),
                                              ((5, 64), torch.float16)])
def test_fused_add_rms_norm(shape, dtype):
    x = _randn(*shape, dtype=dtype, seed=3)
    residual = _randn(*shape, dtype=dtype, seed=4)
    w = _randn(shape[-1], dtype=dtype, seed=5, scale=0.5) + 1
    x_before, r_before = x.clone(), residual.clone()
    normed, summed = tri.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, w, 1e-5)
    assert summed.dtype == ref_summed.dtype and normed.dtype == ref_normed.dtype
    # One rounding of an exact fp32 sum. The interpreter truncates fp32 -> bf16 (GPUs round to nearest
    # even), so bf16 may differ by one unit in the last place there.
    exact = dtype != torch.bfloat16 or DEVICE == "cuda"
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0 if exact else 2**-7)
    _close(normed, ref_normed, TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs untouched


def test_rms_norm_strided_rows():
    base = _randn(6, 160, seed=6)
    x = base[:, :100]  # row stride 160, last dim contiguous
    w = _randn(100, seed=7)
    _close(tri.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), TOL[torch.float32])


# ------------------------------------------------------------------------------------------ activation


@pytest.mark.parametrize(("shape", "dtype"), [((7, 200), torch.float32), ((2, 3, 128), torch.bfloat16),
                                              ((9, 86), torch.float16)])
def test_silu_and_mul(shape, dtype):
    x = _randn(*shape, dtype=dtype, seed=8, scale=2.0)
    expected = reference.silu_and_mul(x)
    actual = tri.silu_and_mul(x)
    assert actual.shape == expected.shape
    _close(actual, expected, TOL[dtype])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError):
        tri.silu_and_mul(_randn(2, 7))


# ---------------------------------------------------------------------------------------------- rotary


def _cos_sin(max_pos: int, rotary_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _qkv(tokens, hq, hkv, head_dim, dtype, seed):
    """q, k, v as strided views of one fused projection, as the model produces them."""
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    return q.view(tokens, hq, head_dim), k.view(tokens, hkv, head_dim), v.view(tokens, hkv, head_dim)


@pytest.mark.parametrize(
    ("tokens", "hq", "hkv", "head_dim", "rotary_dim", "dtype"),
    [
        (11, 8, 2, 64, 64, torch.float32),
        (5, 8, 1, 128, 128, torch.bfloat16),
        (9, 4, 4, 128, 64, torch.float16),  # partial rotary: dims past rotary_dim pass through
    ],
)
def test_apply_rotary(tokens, hq, hkv, head_dim, rotary_dim, dtype):
    q, k, _ = _qkv(tokens, hq, hkv, head_dim, dtype, seed=9)
    cos, sin = _cos_sin(64, rotary_dim)
    positions = torch.randint(0, 64, (tokens,), generator=_gen(10)).to(DEVICE)
    ref_q, ref_k = reference.apply_rotary(q, k, positions, cos, sin)
    out_q, out_k = tri.apply_rotary(q, k, positions, cos, sin)
    _close(out_q, ref_q, TOL[dtype])
    _close(out_k, ref_k, TOL[dtype])


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter truncates "
                                                          "float32 to bfloat16 where a GPU rounds to nearest")),
    torch.float16,
])
def test_apply_rotary_with_tables_in_the_model_dtype_rounds_each_product_as_the_reference(dtype):
    """A model's tables are in its dtype (``transformers`` and vLLM rotate in it): both twins round each product to
    it, bit for bit; with the products unrounded (float32 arithmetic on the same tables) some values differ."""
    q, k, _ = _qkv(13, 8, 2, 64, dtype, seed=9)
    cos, sin = (table.to(dtype) for table in _cos_sin(64, 64))
    positions = torch.randint(0, 64, (13,), generator=_gen(10)).to(DEVICE)
    ref_q, ref_k = reference.apply_rotary(q, k, positions, cos, sin)
    out_q, out_k = tri.apply_rotary(q, k, positions, cos, sin)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    unrounded_q, _ = reference.apply_rotary(q, k, positions, cos.float(), sin.float())
    assert not torch.equal(unrounded_q, ref_q)


# ------------------------------------------------------------------------------------------- KV cache


def _empty_cache(num_blocks, block_size, hkv, head_dim, dtype, seed) -> PagedKV:
    k_cache = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, seed=seed)
    v_cache = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, seed=seed + 1)
    return PagedKV(k_cache, v_cache)


@pytest.mark.parametrize(("hkv", "head_dim", "block_size", "dtype"),
                         [(2, 64, 16, torch.float32), (1, 128, 8, torch.bfloat16), (4, 128, 32, torch.float16)])
def test_write_kv_cache(hkv, head_dim, block_size, dtype):
    tokens, num_blocks = 13, 6
    _, key, value = _qkv(tokens, 4, hkv, head_dim, dtype, seed=11)
    perm = torch.randperm(num_blocks * block_size, generator=_gen(12))[:tokens]
    slots = perm.clone()
    slots[[2, 7]] = -1  # padding tokens are skipped
    slots = slots.to(DEVICE)
    ref = _empty_cache(num_blocks, block_size, hkv, head_dim, dtype, seed=13)
    out = PagedKV(ref.k.clone(), ref.v.clone())
    reference.write_kv_cache(key, value, ref, slots)
    tri.write_kv_cache(key, value, out, slots)
    assert torch.equal(out.k, ref.k) and torch.equal(out.v, ref.v)


def test_rotary_fused_with_kv_write():
    tokens, hq, hkv, head_dim, block_size, num_blocks = 7, 8, 2, 128, 16, 3
    q, k, v = _qkv(tokens, hq, hkv, head_dim, torch.bfloat16, seed=14)
    cos, sin = _cos_sin(128, 96)  # partial rotary as well
    positions = torch.arange(40, 40 + tokens).to(DEVICE)
    slots = torch.tensor([5, 6, -1, 20, 21, 47, 0]).to(DEVICE)
    ref = _empty_cache(num_blocks, block_size, hkv, head_dim, torch.bfloat16, seed=15)
    out = PagedKV(ref.k.clone(), ref.v.clone())
    ref_q, ref_k = reference.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, ref, slots)
    out_q, out_k = tri.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, out, slots)
    _close(out_q, ref_q, TOL[torch.bfloat16])
    _close(out_k, ref_k, TOL[torch.bfloat16])
    assert torch.equal(out.v, ref.v)
    _close(out.k, ref.k, TOL[torch.bfloat16])
    # the cache holds exactly the rotated keys the op returned
    valid = slots >= 0
    flat = out.k.view(-1, hkv, head_dim)
    assert torch.equal(flat[slots[valid]], out_k[valid])


# ---------------------------------------------------------------------------------------------- attention


def _paged_setup(context_lens, hkv, head_dim, block_size, dtype, seed, pad_tables=-1):
    """A shuffled paged cache holding every sequence's context; tables padded with ``pad_tables``."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=_gen(seed)).tolist()
    width = max(blocks_per_seq) + 1
    tables = torch.full((len(context_lens), width), pad_tables, dtype=torch.int32)
    cursor = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor(perm[cursor : cursor + nb], dtype=torch.int32)
        cursor += nb
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return _empty_cache(num_blocks, block_size, hkv, head_dim, dtype, seed=seed + 1), tables.to(DEVICE), lens.to(DEVICE)


DECODE_CASES = [
    # context_lens, hkv, group, head_dim, block_size, dtype, num_splits, block_n
    ((1, 17, 100), 2, 1, 64, 16, torch.float32, 1, None),
    ((33, 5), 1, 4, 128, 16, torch.bfloat16, 1, None),
    ((70, 129, 3), 1, 8, 64, 32, torch.float16, 1, None),
    ((300, 1, 513), 1, 4, 128, 16, torch.float32, 4, 64),  # split-K, with empty splits for the short one
    ((257, 40), 2, 8, 128, 8, torch.bfloat16, 3, 32),  # split-K, odd split count
]


@pytest.mark.parametrize(("context_lens", "hkv", "group", "head_dim", "block_size", "dtype", "splits", "block_n"),
                         DECODE_CASES)
def test_paged_attention_decode(context_lens, hkv, group, head_dim, block_size, dtype, splits, block_n):
    cache, tables, lens = _paged_setup(context_lens, hkv, head_dim, block_size, dtype, seed=20)
    q = _randn(len(context_lens), hkv * group, head_dim, dtype=dtype, seed=21)
    scale = head_dim**-0.5
    expected = reference.paged_attention_decode(q, cache, tables, lens, scale)
    from megatron_kernels.triton_decode_attention import paged_attention_decode

    actual = paged_attention_decode(q, cache, tables, lens, scale, num_splits=splits, block_n=block_n)
    _close(actual, expected, ATTN_TOL[dtype])


def test_paged_attention_decode_default_launch():
    cache, tables, lens = _paged_setup((45, 9), 2, 64, 16, torch.bfloat16, seed=22)
    q = _randn(2, 8, 64, dtype=torch.bfloat16, seed=23)
    expected = reference.paged_attention_decode(q, cache, tables, lens, 0.125)
    _close(tri.paged_attention_decode(q, cache, tables, lens, 0.125), expected, ATTN_TOL[torch.bfloat16])


PREFILL_CASES = [
    # (context_len, q_len) per sequence, hkv, group, head_dim, block_size, dtype, block_m, block_n
    (((37, 37), (100, 13), (1, 1)), 2, 1, 64, 16, torch.float32, None, None),
    (((50, 50), (64, 0), (130, 1)), 1, 4, 128, 16, torch.bfloat16, None, None),
    (((29, 29), (75, 20)), 1, 8, 64, 8, torch.float16, None, None),
    # small tiles: several query tiles per sequence, unmasked and diagonal key tiles
    (((90, 37), (45, 45)), 1, 1, 128, 16, torch.float32, 32, 16),
    (((61, 23),), 2, 4, 64, 32, torch.bfloat16, 16, 16),
]


@pytest.mark.parametrize(("seqs", "hkv", "group", "head_dim", "block_size", "dtype", "block_m", "block_n"),
                         PREFILL_CASES)
def test_paged_attention_prefill(seqs, hkv, group, head_dim, block_size, dtype, block_m, block_n):
    context_lens = [c for c, _ in seqs]
    q_lens = [n for _, n in seqs]
    cache, tables, lens = _paged_setup(context_lens, hkv, head_dim, block_size, dtype, seed=30)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE)
    q = _randn(sum(q_lens), hkv * group, head_dim, dtype=dtype, seed=31)
    scale = head_dim**-0.5
    expected = reference.paged_attention_prefill(q, cache, tables, qsl, lens, scale)
    from megatron_kernels.triton_prefill_attention import paged_attention_prefill

    actual = paged_attention_prefill(q, cache, tables, qsl, lens, scale, block_m=block_m, block_n=block_n)
    _close(actual, expected, ATTN_TOL[dtype])


def test_prefill_single_token_queries_match_decode():
    """A prefill of one query per sequence is a decode step: both kernels agree."""
    context_lens = (19, 64, 7)
    cache, tables, lens = _paged_setup(context_lens, 2, 64, 16, torch.float32, seed=40)
    q = _randn(3, 8, 64, seed=41)
    qsl = torch.arange(4, dtype=torch.int32).to(DEVICE)
    decode = tri.paged_attention_decode(q, cache, tables, lens, 0.125)
    prefill = tri.paged_attention_prefill(q, cache, tables, qsl, lens, 0.125)
    _close(prefill, decode, ATTN_TOL[torch.float32])


def test_decode_groups_fixed_cost_counts_the_elements_of_a_block():
    """A group's fixed cost is counted in key elements, not in blocks: a small model's blocks are cheap to pad, so
    the same decode lengths make one group there and several for a model of wider heads (a fixed count of blocks
    split the served tiny model's batches into groups that each cost more than the padding they saved)."""
    lens = tuple(range(129, 225, 3))  # 32 decoding sequences of 9 to 14 blocks of 16
    tiny = reference.decode_groups(lens, 16, reference.group_cost(16, 2, 16))  # the served tiny model's cache
    wide = reference.decode_groups(lens, 16, reference.group_cost(16, 4, 64))  # the benchmark model's
    assert len(tiny) == 1 < len(wide)
    assert reference.group_cost(16, 64, 256) == 1  # never free: one block at least


def test_reference_decode_in_length_groups_matches_attention_per_sequence():
    """The reference decode pads each group of similar lengths to its longest only; each row still equals the
    reference prefill's attention of one query over that sequence alone (another path, no padding), and a
    sequence of context 0 attends to nothing (NaN)."""
    context_lens = (1, 700, 17, 690, 100, 0, 300, 33, 16, 680)
    groups = reference.decode_groups(context_lens, 16, reference.group_cost(16, 2, 64))
    assert len(groups) > 1, "the lengths must make several groups for this test to mean anything"
    assert [start for start, _, _ in groups] == [0, *(end for _, end, _ in groups[:-1])]
    assert groups[-1][1] == len(context_lens)
    assert reference.decode_groups((300,) * 10, 16, 1) == ((0, 10, 19),)  # one length: one group
    cache, tables, lens = _paged_setup(context_lens, 2, 64, 16, torch.float32, seed=42)
    cache = PagedKV(cache.k.cpu(), cache.v.cpu())
    q = _randn(len(context_lens), 8, 64, seed=43)
    decode = reference.paged_attention_decode(q.cpu(), cache, tables.cpu(), lens.cpu(), 0.125)
    for row, length in enumerate(context_lens):
        if not length:
            assert decode[row].isnan().all()
            continue
        alone = reference.paged_attention_prefill(q[row : row + 1].cpu(), cache, tables[row : row + 1].cpu(),
                                                  torch.tensor([0, 1], dtype=torch.int32),
                                                  lens[row : row + 1].cpu(), 0.125)
        _close(decode[row : row + 1], alone, TOL[torch.float32])
