"""The CPU path's own choices, each held to the arithmetic it replaces: the heads-first KV layout, torch's
``F.rms_norm``, the in-place rotary, oneDNN's GEMM for the dense layers, and the heap setting of a CPU engine."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from megatron_kernels import dense, reference
from megatron_kernels.fp8 import quantize_heads
from megatron_kernels.paged_kv import PagedKV
from megatron_serve.heap import keep_freed_memory


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pools(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype, seed: int):
    """The same keys and values in a blocks-first pool and in a heads-first one (``KVCachePool(heads_first=True)``'s
    view: ``[blocks, block_size, Hkv, D]`` over memory ordered ``[Hkv, blocks, block_size, D]``)."""
    plain = [torch.randn(num_blocks, block_size, heads, dim, generator=_gen(seed + i)).to(dtype) for i in range(2)]
    heads_first = [p.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for p in plain]
    assert all(torch.equal(a, b) and a.stride() != b.stride() for a, b in zip(plain, heads_first))
    return plain, heads_first


def _tables(lengths: list[int], block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Shuffled block tables, padded with -1 past each sequence's blocks."""
    perm = torch.randperm(num_blocks, generator=_gen(seed)).tolist()
    width = max(-(-n // block_size) for n in lengths) + 1
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        count = -(-n // block_size)
        tables[row, :count] = torch.tensor(perm[:count], dtype=torch.int32)
        perm = perm[count:]
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
def test_attention_over_a_heads_first_pool_is_the_blocks_first_one_bit_for_bit(dtype):
    lengths, block_size, heads, group, dim = [1, 40, 17, 300, 33, 0, 64], 16, 2, 4, 32
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    scales: dict[str, torch.Tensor] = {}
    if dtype == "fp8":  # e4m3 values and a scale per slot and head, as KVCachePool(fp8=True) holds them
        plain, heads_first = _pools(num_blocks, block_size, heads, dim, torch.float32, seed=1)
        for name, cache, first in zip(("k_scales", "v_scales"), plain, heads_first):
            values, slot_scales = quantize_heads(cache.flatten(0, 1))
            first.copy_(values.view(cache.shape).float())
            scales[name] = slot_scales.view(num_blocks, block_size, heads)
        plain = [first.contiguous().to(torch.float8_e4m3fn) for first in heads_first]
        heads_first = [p.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for p in plain]
        dtype = torch.float32
    else:
        plain, heads_first = _pools(num_blocks, block_size, heads, dim, dtype, seed=1)
    tables = _tables(lengths, block_size, num_blocks, seed=2)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), heads * group, dim, generator=_gen(3)).to(dtype)
    plain, heads_first = PagedKV(*plain, **scales), PagedKV(*heads_first, **scales)
    decode = [reference.paged_attention_decode(q, pool, tables, lens, 0.2) for pool in (plain, heads_first)]
    assert decode[0][lengths.index(0)].isnan().all()  # a padding row attends to nothing
    assert torch.equal(decode[0].nan_to_num(), decode[1].nan_to_num())
    chunks = [(40, 40), (300, 7), (33, 1), (64, 20)]  # (context, queries): whole prompts and chunks after a prefix
    rows = [1, 3, 4, 6]
    starts = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    queries = torch.randn(int(starts[-1]), heads * group, dim, generator=_gen(4)).to(dtype)
    prefill = [reference.paged_attention_prefill(queries, pool, tables[rows], starts, lens[rows], 0.2)
               for pool in (plain, heads_first)]
    assert torch.equal(prefill[0], prefill[1])


def test_rms_norm_in_float32_is_the_ops_of_its_formula_bit_for_bit():
    for shape in [(1, 8), (3, 100), (64, 512), (7, 4096), (2, 5, 128)]:
        x = torch.randn(shape, generator=_gen(5)) * 7
        weight = torch.randn(shape[-1], generator=_gen(6))
        for eps in (1e-5, 1e-6):
            by_ops = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            assert torch.equal(reference.rms_norm(x, weight, eps), by_ops)
    half = torch.randn(4, 64, generator=_gen(7)).to(torch.bfloat16)  # other dtypes: the ops themselves
    x32 = half.float()
    expected = torch.ones(64, dtype=torch.bfloat16) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
                                                      ).to(torch.bfloat16)
    assert torch.equal(reference.rms_norm(half, torch.ones(64, dtype=torch.bfloat16), 1e-6), expected)


@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_written_in_place_is_the_concatenated_formula(rotary_dim):
    q, k = torch.randn(9, 4, 64, generator=_gen(8)), torch.randn(9, 2, 64, generator=_gen(9))
    cos, sin = torch.randn(50, rotary_dim // 2, generator=_gen(10)), torch.randn(50, rotary_dim // 2, generator=_gen(11))
    positions = torch.randint(0, 50, (9,), generator=_gen(12))
    half = rotary_dim // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x, rotated in zip((q, k), reference.apply_rotary(q, k, positions, cos, sin)):
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        assert torch.equal(rotated, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotary_dim:]), dim=-1))


@pytest.mark.skipif(not dense.ONEDNN, reason="this torch has no oneDNN")
def test_the_dense_linear_is_onednn_and_a_row_does_not_depend_on_the_rows_beside_it(monkeypatch):
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(dense.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or onednn(*a))
    small = torch.randn(72, 96, generator=_gen(16))
    x = torch.randn(40, 384, generator=_gen(13))
    assert torch.equal(dense.linear(x[:, :96], small), F.linear(x[:, :96], small)) and not calls  # MKL's: cheaper
    # a model's weight, as the engine's layers pass it (a plain tensor's rows kept their bits only from 16 rows on
    # one CPU measured: dense's docstring)
    weight = torch.nn.Parameter(torch.randn(384, 384, generator=_gen(14)), requires_grad=False)
    bias = torch.randn(384, generator=_gen(15))
    assert weight.numel() >= dense.ONEDNN_MIN_WEIGHT > small.numel()
    full = dense.linear(x, weight, bias)
    assert calls and full.shape == (40, 384)
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    for start, stop in [(0, 2), (5, 9), (3, 40), (17, 20)]:  # from two rows on (one row runs another kernel)
        assert torch.equal(dense.linear(x[start:stop], weight, bias), full[start:stop])
    weight.mul_(2)  # a refit writes the weight in place: nothing was packed or cached
    torch.testing.assert_close(dense.linear(x, weight, bias), F.linear(x, weight, bias), atol=2e-4, rtol=1e-4)
    assert dense.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).dtype == torch.bfloat16  # F.linear's


@pytest.mark.skipif(not dense.BLOCKED, reason="torch without oneDNN's weight reorder")
def test_a_parameter_is_reordered_once_the_same_bits_and_again_after_any_write():
    """A model's weight keeps its oneDNN-blocked copy between calls, computes the bits the plain weight does, and
    a write through the loader (a slice of it, as a fused layer's part) or in place is seen at the next call. The
    bits are compared at row counts where oneDNN runs one kernel for both layouts on every CPU measured (from 16; a
    GPU host's Xeon ran the plain weight otherwise at 2-15); between them a row keeps its bits. One row takes MKL's
    matrix-vector kernel (``F.linear``) on the plain weight."""
    from megatron_serve.model.tensor_source import copy_checked

    weight = torch.nn.Parameter(torch.randn(768, 256, generator=_gen(20)), requires_grad=False)
    plain = weight.detach().clone()
    x = torch.randn(37, 256, generator=_gen(21))
    onednn = torch.ops.mkldnn._linear_pointwise
    assert torch.equal(dense.linear(x[:1], weight), F.linear(x[:1], plain))  # one row: MKL's matrix-vector kernel
    for rows in (16, 37):
        assert torch.equal(dense.linear(x[:rows], weight), onednn(x[:rows], plain, None, "none", [], "")), rows
    for rows in (2, 5):
        assert torch.equal(dense.linear(x[:rows], weight), dense.linear(x, weight)[:rows]), rows
    kept = weight._onednn_blocked[1]
    dense.linear(x, weight)
    assert weight._onednn_blocked[1] is kept  # reordered once
    with torch.inference_mode():  # a refit writes one fused part through the loader, in inference mode
        copy_checked(weight.narrow(0, 256, 256), torch.ones(256, 256))
    plain[256:512] = 1
    assert torch.equal(dense.linear(x, weight), onednn(x, plain, None, "none", [], ""))
    weight.mul_(3)
    assert torch.equal(dense.linear(x, weight), onednn(x, plain * 3, None, "none", [], ""))
    dequantized = torch.randn(768, 256, generator=_gen(22))  # a tensor made for one call: nothing kept on it
    dense.linear(x, dequantized)
    assert not hasattr(dequantized, "_onednn_blocked")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_glibc_takes_the_heap_thresholds_of_a_cpu_engine():
    """Both values within what ``mallopt`` accepts (it refuses a mapping threshold above 32 MiB, say, and
    ``keep_freed_memory`` then says so). What they save, counted in page faults: docs/design-measurements.md."""
    assert keep_freed_memory()
