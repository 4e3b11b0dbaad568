"""The batch-invariant paged attention kernel (``triton_invariant_attention``): a row's output is ``==``
whatever else the launch holds (1, 7 or 33 rows), however the step reaches it (prefill, decode, chunked
prefill, a prefix-cache hit) and wherever its blocks lie; close to its PyTorch twin and to textbook softmax
attention. Under the Triton interpreter on CPU (numpy arithmetic: there the invariance holds by
construction, the GPU run is the real check), natively on CUDA. Tiny shapes: each program costs about 1.5 ms
interpreted."""

from __future__ import annotations

import pytest
import torch

from megatron_serve.model.attention import AttentionMetadata, ForwardContext, PagedAttention

from megatron_kernels.paged_kv import PagedKV
from megatron_kernels.triton_invariant_attention import (
    KEY_BLOCK, attend_step, dense_attention, paged_attention, plain_attention, reference_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, KV_HEADS, HEADS, DIM, SCALE = 16, 2, 4, 16, 0.25
LENGTHS = (50, 70, 9, 33)  # keys of the test's sequences: partial last blocks, one block, one key past a block
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


class Pool:
    """Sequences' keys and values (``[S, L, Hkv, D]``) written into a paged cache through a block table;
    every block no sequence owns holds NaN (a kernel that read past a row's keys would say so)."""

    def __init__(self, dtype: torch.dtype = torch.float32, blocks: int = 40):
        self.keys = [_randn(n, KV_HEADS, DIM, seed=10 + i, dtype=dtype) for i, n in enumerate(LENGTHS)]
        self.values = [_randn(n, KV_HEADS, DIM, seed=20 + i, dtype=dtype) for i, n in enumerate(LENGTHS)]
        self.blocks, self.dtype = blocks, dtype

    def layout(self, seed: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache, table)``: the sequences' ``block``-key blocks at a random permutation of the cache."""
        width = max(-(-n // block) for n in LENGTHS)
        free = torch.randperm(self.blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        table = torch.zeros(len(LENGTHS), width, dtype=torch.int32)
        k_cache = torch.full((self.blocks, block, KV_HEADS, DIM), float("nan"), dtype=self.dtype, device=DEVICE)
        v_cache = k_cache.clone()
        for s, n in enumerate(LENGTHS):
            for b in range(-(-n // block)):
                table[s, b] = physical = free.pop()
                end = min(n, (b + 1) * block)
                k_cache[physical, :end - b * block] = self.keys[s][b * block:end]
                v_cache[physical, :end - b * block] = self.values[s][b * block:end]
        return k_cache, v_cache, table.to(DEVICE)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences as a trainer holds them: ``[S, Hkv, L, D]``, zeros past each one's end."""
        length = max(LENGTHS)
        keys = torch.zeros(len(LENGTHS), KV_HEADS, length, DIM, dtype=self.dtype, device=DEVICE)
        values = torch.zeros_like(keys)
        for s, n in enumerate(LENGTHS):
            keys[s, :, :n] = self.keys[s].transpose(0, 1)
            values[s, :, :n] = self.values[s].transpose(0, 1)
        return keys, values


def _rows(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` query rows at random (sequence, position) pairs."""
    generator = torch.Generator().manual_seed(seed)
    sequence = torch.randint(len(LENGTHS), (count,), generator=generator)
    positions = (torch.rand(count, generator=generator) * torch.tensor(LENGTHS)[sequence]).long()
    return sequence.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_and_in_batches_of_1_7_33(dtype: torch.dtype) -> None:
    pool = Pool(dtype)
    k_cache, v_cache, table = pool.layout(seed=0)
    q = _randn(33, HEADS, DIM, seed=1, dtype=dtype)
    sequence, positions = _rows(33, seed=2)
    full = paged_attention(q, k_cache, v_cache, table, sequence, positions, SCALE)
    assert not full.isnan().any()
    for count in (1, 7):
        assert torch.equal(paged_attention(q[:count], k_cache, v_cache, table, sequence[:count], positions[:count],
                                           SCALE), full[:count])
    for row in (0, 6, 20, 32):  # alone, taken from the middle of the batch
        alone = paged_attention(q[row:row + 1], k_cache, v_cache, table, sequence[row:row + 1],
                                positions[row:row + 1], SCALE)
        assert torch.equal(alone[0], full[row])


def _metadata(q: torch.Tensor, table: torch.Tensor, decode: list[tuple[int, int]],
              chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """An engine step's rows and metadata: ``decode`` (sequence, length) rows, then prefill ``chunks`` (sequence,
    first position, rows), the query of each row taken from ``q`` ``[S, L, Hq, D]`` at its position."""
    rows = [q[s, n - 1] for s, n in decode] + [q[s, p] for s, first, count in chunks
                                              for p in range(first, first + count)]
    starts = [0]
    for _, _, count in chunks:
        starts.append(starts[-1] + count)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(rows),), -1, device=DEVICE), num_decode_tokens=len(decode),
        decode_block_tables=table[[s for s, _ in decode]] if decode else None,
        decode_context_lens=torch.tensor([n for _, n in decode], dtype=torch.int32, device=DEVICE) if decode else None,
        prefill_block_tables=table[[s for s, _, _ in chunks]] if chunks else None,
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE) if chunks else None,
        prefill_context_lens=torch.tensor([f + c for _, f, c in chunks], dtype=torch.int32, device=DEVICE)
        if chunks else None)
    return torch.stack(rows), meta


def _step(q: torch.Tensor, k_cache, v_cache, table, decode: list[tuple[int, int]],
          chunks: list[tuple[int, int, int]]) -> torch.Tensor:
    """The step of :func:`_metadata` through :func:`attend_step`, the engine's CUDA call."""
    rows, meta = _metadata(q, table, decode, chunks)
    return attend_step(rows, meta, PagedKV(k_cache, v_cache), SCALE, torch.full_like(rows, float("nan")))


def test_prefill_decode_chunked_prefix_hit_and_mixed_steps_agree() -> None:
    pool = Pool()
    k_cache, v_cache, table = pool.layout(seed=3)
    q = _randn(len(LENGTHS), max(LENGTHS), HEADS, DIM, seed=4)
    cold = _step(q, k_cache, v_cache, table, [], [(0, 0, 50)])  # sequence 0's whole prompt as one prefill
    chunked = torch.cat([_step(q, k_cache, v_cache, table, [], [(0, first, min(16, 50 - first))])
                         for first in range(0, 50, 16)])
    assert torch.equal(chunked, cold)
    hit = _step(q, k_cache, v_cache, table, [], [(0, 32, 18)])  # the first 32 keys came from the prefix cache
    assert torch.equal(hit, cold[32:])
    for length in (1, 33, 50):  # decode rows, alone and beside other sequences' decode rows
        assert torch.equal(_step(q, k_cache, v_cache, table, [(0, length)], [])[0], cold[length - 1])
        assert torch.equal(_step(q, k_cache, v_cache, table, [(2, 9), (0, length), (1, 70)], [])[1], cold[length - 1])
    mixed = _step(q, k_cache, v_cache, table, [(1, 70), (3, 33)], [(2, 0, 9), (0, 16, 34)])  # decode + two chunks
    assert torch.equal(mixed[11:], cold[16:])
    other = _step(q, k_cache, v_cache, table, [], [(1, 69, 1)])
    assert torch.equal(mixed[0], other[0])


def test_a_step_reads_its_rows_as_the_cpu_mode_does() -> None:
    """The same step's metadata through the CPU mode's attention (``PagedAttention`` in ``--batch-invariant``, its
    GEMM formulation) and through the kernel: the same rows, sequences and positions (close: other sum orders)."""
    k_cache, v_cache, table = Pool().layout(seed=34)
    q = _randn(len(LENGTHS), max(LENGTHS), HEADS, DIM, seed=35)
    rows, meta = _metadata(q, table, [(1, 70), (3, 33), (2, 4)], [(2, 0, 9), (0, 16, 34)])
    attention = PagedAttention(0, SCALE, torch.device("cpu"))
    attention.batch_invariant = True
    on_cpu = AttentionMetadata(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()})
    caches = [(k_cache.nan_to_num(0.0).cpu(), v_cache.nan_to_num(0.0).cpu())]
    cpu_mode = attention.attend(rows.cpu(), ForwardContext(on_cpu, caches))
    kernel = attend_step(rows, meta, PagedKV(k_cache, v_cache), SCALE, torch.empty_like(rows))
    torch.testing.assert_close(kernel.cpu(), cpu_mode, atol=1e-5, rtol=1e-5)


def test_the_block_table_layout_changes_no_bit() -> None:
    pool = Pool()
    q = _randn(7, HEADS, DIM, seed=5)
    sequence, positions = _rows(7, seed=6)
    outs = [paged_attention(q, *pool.layout(seed), sequence, positions, SCALE) for seed in (7, 8, 9)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_step_of_many_chunks_finds_each_row_s_chunk() -> None:
    """Five prefill chunks after three decode rows (the kernel's binary search over the chunks' starts takes three
    steps): every row as its sequence's own row at that position, launched alone."""
    pool = Pool()
    k_cache, v_cache, table = pool.layout(seed=36)
    q = _randn(len(LENGTHS), max(LENGTHS), HEADS, DIM, seed=37)
    decode, chunks = [(0, 50), (1, 2), (3, 33)], [(2, 0, 3), (1, 40, 1), (0, 10, 5), (3, 31, 2), (1, 60, 10)]
    rows, _ = _metadata(q, table, decode, chunks)
    step = _step(q, k_cache, v_cache, table, decode, chunks)
    sequence = [s for s, _ in decode] + [s for s, _, count in chunks for _ in range(count)]
    positions = [n - 1 for _, n in decode] + [p for _, first, count in chunks for p in range(first, first + count)]
    for row, (seq, position) in enumerate(zip(sequence, positions)):
        alone = paged_attention(rows[row:row + 1], k_cache, v_cache, table, torch.tensor([seq], device=DEVICE),
                                torch.tensor([position], device=DEVICE), SCALE)
        assert torch.equal(alone[0], step[row]), f"row {row}"


def test_close_to_the_pytorch_twin_and_to_plain_softmax_attention() -> None:
    pool = Pool()
    k_cache, v_cache, table = pool.layout(seed=10)
    q = _randn(33, HEADS, DIM, seed=11)
    sequence, positions = _rows(33, seed=12)
    out = paged_attention(q, k_cache, v_cache, table, sequence, positions, SCALE)
    twin = reference_attention(q, k_cache, v_cache, table, sequence, positions, SCALE)
    torch.testing.assert_close(out, twin, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, plain_attention(q, *pool.dense(), sequence, positions, SCALE), atol=1e-5, rtol=1e-5)


def test_padding_rows_write_zeros_and_read_nothing() -> None:
    pool = Pool()
    k_cache, v_cache, table = pool.layout(seed=13)
    q = _randn(3, HEADS, DIM, seed=14)
    out = paged_attention(q, k_cache, v_cache, table, torch.tensor([0, 1, 0], device=DEVICE),
                          torch.tensor([-1, 5, -1], device=DEVICE), SCALE)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]])) and not out[1].isnan().any()


def test_variable_key_blocks_change_the_bits() -> None:
    """Negative control: a kernel whose key block follows the launch (split-K over the context, or a block per
    prefill chunk, as the default mode's kernels do) gives rows other bits; the fixed block is what prevents it."""
    pool = Pool()
    k_cache, v_cache, table = pool.layout(seed=15)
    q = _randn(7, HEADS, DIM, seed=16)  # positions 0..32: rows of one, two and three 16-key blocks
    sequence, positions = _rows(7, seed=17)
    fixed = paged_attention(q, k_cache, v_cache, table, sequence, positions, SCALE)
    for block in (KEY_BLOCK // 2, KEY_BLOCK * 2):
        other = paged_attention(q, k_cache, v_cache, table, sequence, positions, SCALE, key_block=block)
        torch.testing.assert_close(other, fixed, atol=1e-5, rtol=1e-5)
        assert not torch.equal(other, fixed)


def test_an_fp8_cache_is_attention_over_its_dequantized_values() -> None:
    """An FP8 cache (one scale per slot and head) is read as e4m3 and widened in registers: close to the kernel
    over the dequantized float32 cache, and a row still the same alone as in a launch of 33."""
    from megatron_kernels import fp8  # noqa: PLC0415

    k_cache, v_cache, table = Pool().layout(seed=31)
    shape = k_cache.shape
    (k8, k_scales), (v8, v_scales) = (fp8.quantize_heads(c.nan_to_num(0.0).flatten(0, 1)) for c in (k_cache, v_cache))
    k8, v8, k_scales, v_scales = k8.view(shape), v8.view(shape), k_scales.view(shape[:3]), v_scales.view(shape[:3])
    q = _randn(33, HEADS, DIM, seed=32)
    sequence, positions = _rows(33, seed=33)
    out = paged_attention(q, k8, v8, table, sequence, positions, SCALE, k_scales=k_scales, v_scales=v_scales)
    dequantized = [c.float() * s[..., None] for c, s in ((k8, k_scales), (v8, v_scales))]
    torch.testing.assert_close(out, paged_attention(q, *dequantized, table, sequence, positions, SCALE),
                               atol=1e-6, rtol=1e-6)
    alone = paged_attention(q[20:21], k8, v8, table, sequence[20:21], positions[20:21], SCALE, k_scales=k_scales,
                            v_scales=v_scales)
    assert torch.equal(alone[0], out[20])


def test_the_default_decode_kernel_changes_bits_with_its_split_count() -> None:
    """Negative control: the default mode's decode kernel picks its split-K count from the batch
    (``split_count``: fewer sequences, more splits); a decode row gets other bits at another split count."""
    from megatron_kernels.triton_decode_attention import paged_attention_decode  # noqa: PLC0415

    k_cache, v_cache, table = Pool().layout(seed=38)
    q = _randn(len(LENGTHS), HEADS, DIM, seed=39)
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device=DEVICE)
    one, four = (paged_attention_decode(q, PagedKV(k_cache, v_cache), table, lens, SCALE, num_splits=n, block_n=16)
                 for n in (1, 4))
    torch.testing.assert_close(four, one, atol=1e-5, rtol=1e-5)
    assert not torch.equal(four, one)


# each dtype once and each page size once (float32 with 16-key blocks, bfloat16 with 64): the other two pairings
# repeated the same launches (bfloat16 at 16 keys, float32 at 64) for twice the interpreter time
@pytest.mark.parametrize("dtype, block", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_the_dense_entry_gives_the_engine_s_bits(dtype: torch.dtype, block: int) -> None:
    """A trainer's unpaged K/V through :func:`dense_attention` (what ``megatron_invariant`` runs on CUDA, in
    64-key pages) equals the engine's paged launch bit for bit, with the engine's CUDA default of 64-token
    blocks and with 16 (on a GPU another compiled variant: the page size must move addresses only)."""
    pool = Pool(dtype)
    q = _randn(33, HEADS, DIM, seed=18, dtype=dtype)
    sequence, positions = _rows(33, seed=19)
    engine = paged_attention(q, *pool.layout(seed=20, block=block), sequence, positions, SCALE)
    assert torch.equal(dense_attention(q, *pool.dense(), sequence, positions, SCALE), engine)


def test_the_dense_entry_is_differentiable_with_the_plain_gradient() -> None:
    pool = Pool()
    keys, values = pool.dense()
    sequence, positions = _rows(7, seed=21)
    inputs = [_randn(7, HEADS, DIM, seed=22).requires_grad_(), keys.requires_grad_(), values.requires_grad_()]
    grad = _randn(7, HEADS, DIM, seed=23)
    dense_attention(*inputs, sequence, positions, SCALE).backward(grad)
    plain_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    plain_attention(*plain_inputs, sequence, positions, SCALE).backward(grad)
    for got, want in zip(inputs, plain_inputs):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


@gpu_only
def test_hf_attention_on_cuda_runs_the_engine_kernel() -> None:
    from megatron_serve.invariant import hf_attention  # noqa: PLC0415

    pool = Pool(torch.bfloat16)
    keys, values = pool.dense()
    length = max(LENGTHS)
    query = _randn(len(LENGTHS), HEADS, length, DIM, seed=24, dtype=torch.bfloat16)
    out, _ = hf_attention(torch.nn.Module(), query, keys, values, None, scaling=SCALE)
    sequence = torch.arange(len(LENGTHS), device=DEVICE).repeat_interleave(length)
    positions = torch.arange(length, device=DEVICE).repeat(len(LENGTHS))
    engine = paged_attention(query.transpose(1, 2).reshape(-1, HEADS, DIM), *pool.layout(seed=25, block=64),
                             sequence, positions, SCALE)
    real = positions < torch.tensor(LENGTHS, device=DEVICE)[sequence]
    assert torch.equal(out.reshape(-1, HEADS, DIM)[real], engine[real])


@gpu_only
def test_a_cuda_graph_replay_equals_the_eager_launch() -> None:
    """The launch reads lengths on the device: captured once, replayed over new rows, it gives the eager bits."""
    pool = Pool(torch.bfloat16)
    k_cache, v_cache, table = pool.layout(seed=26)
    q = _randn(33, HEADS, DIM, seed=27, dtype=torch.bfloat16)
    sequence, positions = _rows(33, seed=28)
    static = [t.clone() for t in (q, sequence, positions)]
    out = torch.empty_like(q)
    paged_attention(*static[:1], k_cache, v_cache, table, *static[1:], SCALE, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*static[:1], k_cache, v_cache, table, *static[1:], SCALE, out=out)
    for seed in (29, 30):
        new_q = _randn(33, HEADS, DIM, seed=seed, dtype=torch.bfloat16)
        new_sequence, new_positions = _rows(33, seed=seed + 10)
        for buffer, value in zip(static, (new_q, new_sequence, new_positions)):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(out, paged_attention(new_q, k_cache, v_cache, table, new_sequence, new_positions, SCALE))
