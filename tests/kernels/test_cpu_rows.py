"""The CPU engine's per-token kernels (C++, built on first use) against the PyTorch reference: the rotary
embedding with its KV-cache write bit for bit, RMSNorm and SwiGLU within float32 rounding, every row the same
whatever rows are beside it (``==``), and the calls they do not serve handed to the reference unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_kernels import cpu_build, cpu_rows, get_op, reference
from megatron_kernels.paged_kv import PagedKV


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_kernels_build_here_and_the_cpu_backend_serves_the_ops_with_them(monkeypatch):
    monkeypatch.delenv("MEGATRON_KERNELS", raising=False)
    assert cpu_rows.built() and cpu_rows.swiglu_built(), "no C++ compiler or ninja on this machine"
    for name in ("apply_rotary_write_kv_cache", "rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        assert get_op(name, "cpu") is getattr(cpu_rows, name)


def _qkv(tokens: int, q_heads: int, kv_heads: int, dim: int, seed: int):
    """q, k, v as the attention layer splits them out of its fused projection: views with a token stride of the
    whole row."""
    fused = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=_gen(seed))
    q, k, v = fused.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("heads_first", [True, False])
@pytest.mark.parametrize(("dim", "rotary_dim"), [(64, 64), (128, 128), (80, 40)])  # 40 of 80: partial rotary
def test_rotary_and_the_cache_write_are_the_reference_bit_for_bit(heads_first, dim, rotary_dim):
    tokens, q_heads, kv_heads, blocks, block_size = 23, 8, 2, 6, 16
    q, k, v = _qkv(tokens, q_heads, kv_heads, dim, seed=1)
    positions = torch.randint(0, 500, (tokens,), generator=_gen(2))
    cos, sin = (torch.randn(512, rotary_dim // 2, generator=_gen(s)) for s in (3, 4))
    slots = torch.randperm(blocks * block_size, generator=_gen(5))[:tokens]
    slots[[4, 11]] = -1  # padding rows of a replayed step: not stored

    def pool() -> torch.Tensor:
        if heads_first:
            return torch.zeros(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
        return torch.zeros(blocks, block_size, kv_heads, dim)

    mine, theirs = PagedKV(pool(), pool()), PagedKV(pool(), pool())
    got = cpu_rows.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, mine, slots)
    want = reference.apply_rotary_write_kv_cache(q, k, v, positions, cos, sin, theirs, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    assert mine[0].abs().sum() > 0


def test_rms_norm_is_the_reference_within_rounding_and_each_row_is_its_own():
    x, residual = (torch.randn(41, 512, generator=_gen(s)) * 3 for s in (6, 7))
    weight = torch.randn(512, generator=_gen(8))
    torch.testing.assert_close(cpu_rows.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               rtol=1e-5, atol=1e-5)
    normed, summed = cpu_rows.fused_add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)  # the residual stream itself: one rounding, as x + residual
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    for start, stop in [(0, 1), (5, 9), (40, 41)]:
        assert torch.equal(cpu_rows.rms_norm(x[start:stop], weight, 1e-6), cpu_rows.rms_norm(x, weight, 1e-6)[start:stop])


def test_swiglu_is_the_reference_within_rounding_and_finite_at_the_extremes():
    x = torch.randn(33, 2 * 700, generator=_gen(9)) * 4
    got = cpu_rows.silu_and_mul(x)
    torch.testing.assert_close(got, reference.silu_and_mul(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu_rows.silu_and_mul(x[7:9]), got[7:9])
    extremes = torch.tensor([[-1000.0, -100.0, -88.0, 0.0, 88.0, 100.0, 1000.0, 3.0] + [2.0] * 8])
    got = cpu_rows.silu_and_mul(extremes)  # fast math assumes no infinity: exp's argument is held finite
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.silu_and_mul(extremes), rtol=1e-5, atol=1e-30)


def test_calls_the_kernels_do_not_serve_are_the_reference_bit_for_bit():
    x = torch.randn(9, 256, generator=_gen(10)).bfloat16()
    weight = torch.randn(128, generator=_gen(11)).bfloat16()
    assert torch.equal(cpu_rows.silu_and_mul(x), reference.silu_and_mul(x))
    assert torch.equal(cpu_rows.rms_norm(x[:, :128], weight, 1e-6), reference.rms_norm(x[:, :128], weight, 1e-6))
    strided = torch.randn(9, 256, generator=_gen(12))[:, ::2]  # not contiguous rows
    assert torch.equal(cpu_rows.rms_norm(strided, weight.float(), 1e-6), reference.rms_norm(strided, weight.float(), 1e-6))


def test_python_m_megatron_kernels_builds_every_cpu_source_and_says_so():
    done = subprocess.run([sys.executable, "-m", "megatron_kernels"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ", ".join(f"{source}: built" for source in cpu_build.SOURCES)
    assert {path.stem for path in cpu_build.CSRC.glob("*.cpp")} == set(cpu_build.SOURCES)
