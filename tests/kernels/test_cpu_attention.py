"""The CPU decode- and prefill-attention kernels (C++, built on first use) against the PyTorch reference they
replace: the same attention within float32 rounding over both pool layouts, every row independent of the batch
around it and (prefill) of how its prompt was cut into chunks (``==``), the calls they do not serve handed to the
reference unchanged, and a machine that cannot build them served by the reference with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_kernels import cpu_attention, cpu_build, get_op, reference
from megatron_kernels.fp8 import quantize_heads
from megatron_kernels.paged_kv import PagedKV

from .test_reference_cpu import _pools, _tables


def _case(lengths: list[int], block_size: int, kv_heads: int, group: int, dim: int, seed: int = 0):
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    plain, heads_first = (PagedKV(*pool) for pool in _pools(num_blocks, block_size, kv_heads, dim, torch.float32, seed))
    tables = _tables([max(n, 1) for n in lengths], block_size, num_blocks, seed)
    q = torch.randn(len(lengths), kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 7))
    return q, plain, heads_first, tables, torch.tensor(lengths, dtype=torch.int32)


def _chunks(lengths: list[int], rows: list[int], block_size: int, kv_heads: int, group: int, dim: int, seed: int = 0):
    """A prefill step: sequence ``i`` has ``lengths[i]`` cached tokens, of which its last ``rows[i]`` are queries."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    plain, heads_first = (PagedKV(*pool) for pool in _pools(num_blocks, block_size, kv_heads, dim, torch.float32, seed))
    tables = _tables([max(n, 1) for n in lengths], block_size, num_blocks, seed)
    q = torch.randn(sum(rows), kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 7))
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    return q, plain, heads_first, tables, starts, torch.tensor(lengths, dtype=torch.int32)


def test_the_kernels_build_here_and_the_cpu_backend_serves_attention_with_them(monkeypatch):
    monkeypatch.delenv("MEGATRON_KERNELS", raising=False)
    assert cpu_attention.built(), "no C++ compiler or ninja on this machine"
    assert get_op("paged_attention_decode", "cpu") is cpu_attention.paged_attention_decode
    assert get_op("paged_attention_prefill", "cpu") is cpu_attention.paged_attention_prefill


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "dim"),
                         [(16, 4, 2, 64), (16, 2, 1, 128), (32, 2, 4, 80), (8, 3, 3, 16), (32, 2, 6, 64)])
def test_decode_is_the_reference_within_rounding_over_both_layouts(block_size, kv_heads, group, dim):
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size - 2, 130, 17]
    q, plain, heads_first, tables, lens = _case(lengths, block_size, kv_heads, group, dim)
    expected = reference.paged_attention_decode(q, plain, tables, lens, dim ** -0.5)
    for pool in (plain, heads_first):
        got = cpu_attention.paged_attention_decode(q, pool, tables, lens, dim ** -0.5)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_each_row_is_the_same_alone_and_in_any_batch():
    """A row's sums run in an order fixed by its own context: alone, among others, reordered, the same bits."""
    lengths = [200, 3, 64, 77, 1, 129, 16, 250]
    q, _, heads_first, tables, lens = _case(lengths, 16, 4, 2, 64, seed=3)
    batch = cpu_attention.paged_attention_decode(q, heads_first, tables, lens, 0.125)
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    shuffled = cpu_attention.paged_attention_decode(q[order], heads_first, tables[order], lens[order], 0.125)
    assert torch.equal(shuffled, batch[order])
    for row in range(len(lengths)):
        alone = cpu_attention.paged_attention_decode(q[row:row + 1], heads_first, tables[row:row + 1, :],
                                                     lens[row:row + 1], 0.125)
        assert torch.equal(alone, batch[row:row + 1]), row


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "dim"),
                         [(16, 4, 2, 64), (16, 2, 1, 128), (32, 2, 4, 80), (8, 3, 3, 16), (16, 2, 5, 64)])
def test_prefill_is_the_reference_within_rounding_over_both_layouts(block_size, kv_heads, group, dim):
    """Whole prompts, chunks after a cached prefix, a single row, a sequence with no rows in this step."""
    lengths, rows = [5, 40, 130, 17, 33, 9, 300], [5, 40, 20, 1, 33, 0, 37]
    q, plain, heads_first, tables, starts, lens = _chunks(lengths, rows, block_size, kv_heads, group, dim)
    expected = reference.paged_attention_prefill(q, plain, tables, starts, lens, dim ** -0.5)
    for pool in (plain, heads_first):
        got = cpu_attention.paged_attention_prefill(q, pool, tables, starts, lens, dim ** -0.5)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_prefill_row_is_the_same_in_any_batch_and_any_chunk_of_its_prompt():
    """A row's sums are set by its own position: its prompt whole or cut into chunks, the sequence alone or among
    others, the same bits. Control: the reference (torch's flash kernel, tiled by the chunk) is not."""
    prompt, block_size, kv_heads, group, dim = 150, 16, 4, 2, 64
    q, _, pool, tables, _, _ = _chunks([prompt, 70, 33], [prompt, 70, 33], block_size, kv_heads, group, dim, seed=5)
    others = q[prompt:]  # rows of the two other sequences

    def attend(kernel, cuts: list[int], beside: bool) -> torch.Tensor:
        """The prompt's rows, computed in chunks ending at each cut, optionally beside the other sequences."""
        pieces, start = [], 0
        for cut in cuts:
            rows = torch.cat([q[start:cut], others]) if beside else q[start:cut]
            lens = [cut, 70, 33] if beside else [cut]
            counts = [cut - start, 70, 33] if beside else [cut - start]
            starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
            table = tables if beside else tables[:1]
            out = kernel(rows, pool, table, starts, torch.tensor(lens, dtype=torch.int32), dim ** -0.5)
            pieces.append(out[:cut - start])
            start = cut
        return torch.cat(pieces)

    whole = attend(cpu_attention.paged_attention_prefill, [prompt], beside=False)
    for cuts, beside in (([prompt], True), ([1, 17, 64, 65, prompt], False), ([3, 100, prompt], True),
                         (list(range(1, prompt + 1)), False)):
        assert torch.equal(attend(cpu_attention.paged_attention_prefill, cuts, beside), whole), (cuts, beside)
    control = [attend(reference.paged_attention_prefill, cuts, False) for cuts in ([prompt], [1, 17, 64, 65, prompt])]
    assert not torch.equal(*control), "the reference gave the same bits for both chunkings: this test shows nothing"


def test_prefill_writes_in_place_and_a_sequence_with_no_context_is_nan():
    q, _, heads_first, tables, starts, lens = _chunks([40, 0, 9], [3, 2, 4], 16, 2, 2, 32)
    buffer = torch.zeros(11, 4, 32)
    result = cpu_attention.paged_attention_prefill(q, heads_first, tables, starts, lens, 0.3, out=buffer[1:10])
    assert result.data_ptr() == buffer[1:10].data_ptr()
    assert torch.isnan(buffer[4:6]).all() and not torch.isnan(buffer[1:4]).any() and not torch.isnan(buffer[6:10]).any()
    assert torch.equal(buffer[0], torch.zeros(4, 32)) and torch.equal(buffer[10], torch.zeros(4, 32))


def test_out_is_written_in_place_and_an_empty_context_row_is_nan():
    q, _, heads_first, tables, lens = _case([40, 0, 9], 16, 2, 2, 32)
    buffer = torch.zeros(5, 4, 32)
    result = cpu_attention.paged_attention_decode(q, heads_first, tables, lens, 0.3, out=buffer[1:4])
    assert result.data_ptr() == buffer[1:4].data_ptr()
    assert torch.isnan(buffer[2]).all() and not torch.isnan(buffer[1]).any() and not torch.isnan(buffer[3]).any()
    assert torch.equal(buffer[0], torch.zeros(4, 32)) and torch.equal(buffer[4], torch.zeros(4, 32))


def test_calls_the_kernel_does_not_serve_are_the_reference_bit_for_bit():
    """A 16-bit model's decode and an FP8 cache's (its scales) keep the reference's arithmetic exactly, prefill too."""
    q, plain, _, tables, lens = _case([33, 7, 90], 16, 2, 2, 64)
    half = PagedKV(plain.k.bfloat16(), plain.v.bfloat16())
    assert torch.equal(cpu_attention.paged_attention_decode(q.bfloat16(), half, tables, lens, 0.125),
                       reference.paged_attention_decode(q.bfloat16(), half, tables, lens, 0.125))
    (k8, k_scales), (v8, v_scales) = (quantize_heads(cache.flatten(0, 1)) for cache in (plain.k, plain.v))
    shape = plain.k.shape  # a scale per slot and head
    fp8 = PagedKV(k8.view(shape), v8.view(shape), k_scales.view(shape[:3]), v_scales.view(shape[:3]))
    assert torch.equal(cpu_attention.paged_attention_decode(q, fp8, tables, lens, 0.125),
                       reference.paged_attention_decode(q, fp8, tables, lens, 0.125))
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # one query row each, the last of its context
    assert torch.equal(cpu_attention.paged_attention_prefill(q.bfloat16(), half, tables, starts, lens, 0.125),
                       reference.paged_attention_prefill(q.bfloat16(), half, tables, starts, lens, 0.125))
    assert torch.equal(cpu_attention.paged_attention_prefill(q, fp8, tables, starts, lens, 0.125),
                       reference.paged_attention_prefill(q, fp8, tables, starts, lens, 0.125))


def test_a_machine_that_cannot_build_it_gets_the_reference_and_a_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_build, "LOADED", {})  # a process that never built it (the loaded library stays loaded)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        q, plain, _, tables, lens = _case([20, 50], 16, 2, 2, 64)
        got = cpu_attention.paged_attention_decode(q, plain, tables, lens, 0.125)
    assert torch.equal(got, reference.paged_attention_decode(q, plain, tables, lens, 0.125))
    assert "Ninja is required" in caplog.text and "reference" in caplog.text


def test_each_environment_and_torch_builds_its_own_library(tmp_path):
    """Another environment's copy of a source (its own path) gets a library of its own, never this one rebuilt."""
    copy = tmp_path / cpu_attention.SOURCE.name
    copy.write_bytes(cpu_attention.SOURCE.read_bytes())
    assert cpu_build.build_tag(copy) != cpu_build.build_tag(cpu_attention.SOURCE)
    assert cpu_build.build_tag(cpu_attention.SOURCE) == cpu_build.build_tag(cpu_attention.SOURCE)


def test_another_venv_with_the_same_torch_version_builds_its_own_library(monkeypatch, tmp_path):
    """A second venv of this checkout (``.venv-verl``) holds the same torch version and source path but builds with
    its own include paths: one name for both was rebuilt by each venv in turn, a compile at each switch."""
    here = cpu_build.build_tag(cpu_attention.SOURCE)
    elsewhere = tmp_path / "other-venv" / "torch"
    elsewhere.mkdir(parents=True)
    monkeypatch.setattr(torch, "__file__", str(elsewhere / "__init__.py"))  # the other venv's torch, same version
    assert cpu_build.build_tag(cpu_attention.SOURCE) != here


def test_loading_the_kernels_leaves_the_process_keeping_denormals():
    """Built with ``-ffast-math`` but not linked with it: the process still computes with subnormal floats (a
    library linked with ``crtfastmath`` would flush them to zero for every op of every model in it)."""
    assert all(cpu_build.built(source) for source in cpu_build.SOURCES)
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() != 0.0 and (tiny / 4 * 4).item() == pytest.approx(1e-39, rel=1e-3)
