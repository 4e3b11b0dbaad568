"""The CPU ``--batch-invariant`` attention (``megatron_kernels.invariant_attention``) through the engine's
``PagedAttention``: a query row's output is ``==`` however the step reaches it (a cold prefill, chunks of 16,
a decode row alone or beside others, a prefix-cache hit's chunk), whatever the cache layout (heads first or
not, any block placement), with NaN in every slot no sequence owns; the trainer's dense entry gives the same
bits and is differentiable; close to textbook softmax attention. The control: in a GEMM of one row
(no tile) a decode row gets other bits than the same row in a prefill."""

from __future__ import annotations

import sys

import torch

from megatron_kernels import invariant
from megatron_kernels.invariant_attention import attention
from megatron_serve.model.attention import AttentionMetadata, ForwardContext, PagedAttention

BLOCK, KV_HEADS, HEADS, DIM, SCALE = 16, 2, 4, 16, 0.25  # 2 query heads per KV head: decode rows are repeated
LENGTHS = (50, 70, 9, 33, 100)  # partial last blocks, a single block, one key past a block


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


KEYS = [_randn(n, KV_HEADS, DIM, seed=10 + i) for i, n in enumerate(LENGTHS)]
VALUES = [_randn(n, KV_HEADS, DIM, seed=20 + i) for i, n in enumerate(LENGTHS)]
QUERIES = [_randn(n, HEADS, DIM, seed=30 + i) for i, n in enumerate(LENGTHS)]  # the query at each position


def _cache(seed: int, heads_first: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache, table)``: the sequences' blocks at a random placement; NaN in every slot no sequence
    owns, the tails of their last blocks included."""
    blocks = 40
    free = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(LENGTHS), -(-max(LENGTHS) // BLOCK)), -1, dtype=torch.int32)
    if heads_first:  # seen as [blocks, block, heads, dim], as KVCachePool(heads_first=True) shows it
        k_cache, v_cache = (torch.full((KV_HEADS, blocks, BLOCK, DIM), float("nan")).permute(1, 2, 0, 3)
                            for _ in range(2))
    else:
        k_cache, v_cache = (torch.full((blocks, BLOCK, KV_HEADS, DIM), float("nan")) for _ in range(2))
    for s, n in enumerate(LENGTHS):
        for b in range(-(-n // BLOCK)):
            table[s, b] = physical = free.pop()
            end = min(n, (b + 1) * BLOCK)
            k_cache[physical, :end - b * BLOCK] = KEYS[s][b * BLOCK:end]
            v_cache[physical, :end - b * BLOCK] = VALUES[s][b * BLOCK:end]
    return k_cache, v_cache, table


def _step(cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor], decode: list[tuple[int, int]],
          prefill: list[tuple[int, int, int]]) -> torch.Tensor:
    """One engine step: decode rows ``(sequence, context length)`` first, then prefill chunks ``(sequence,
    first position, rows)``; returns the rows' outputs in that order."""
    k_cache, v_cache, table = cache
    rows = [QUERIES[s][n - 1:n] for s, n in decode] + [QUERIES[s][start:start + count] for s, start, count in prefill]
    starts = [0]
    for _, _, count in prefill:
        starts.append(starts[-1] + count)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(decode),
        decode_block_tables=table[[s for s, _ in decode]] if decode else None,
        decode_context_lens=torch.tensor([n for _, n in decode], dtype=torch.int32) if decode else None,
        prefill_block_tables=table[[s for s, _, _ in prefill]] if prefill else None,
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32) if prefill else None,
        prefill_context_lens=torch.tensor([start + count for _, start, count in prefill], dtype=torch.int32)
        if prefill else None)
    layer = PagedAttention(0, SCALE, torch.device("cpu"))
    layer.batch_invariant = True
    with torch.inference_mode():
        return layer.attend(torch.cat(rows), ForwardContext(meta, [(k_cache, v_cache)]))


def _cold(cache) -> list[torch.Tensor]:
    """Every sequence's rows in one prefill each, alone."""
    return [_step(cache, [], [(s, 0, n)]) for s, n in enumerate(LENGTHS)]


def test_a_row_is_the_same_alone_beside_others_chunked_and_decoded() -> None:
    cache = _cache(seed=1)
    cold = _cold(cache)
    for s, n in enumerate(LENGTHS):
        for length in (1, n // 2 + 1, n):  # a decode row alone, then beside every other sequence's decode row
            assert torch.equal(_step(cache, [(s, length)], [])[0], cold[s][length - 1])
            others = [(o, m) for o, m in enumerate(LENGTHS) if o != s]
            assert torch.equal(_step(cache, [*others, (s, length)], [])[-1], cold[s][length - 1])
        chunks = [(s, start, min(16, n - start)) for start in range(0, n, 16)]  # chunked prefill of 16 rows
        assert torch.equal(torch.cat([_step(cache, [], [chunk]) for chunk in chunks]), cold[s])
    # a mixed step: decode rows, a prefix hit's chunk (the first 32 keys cached) and a cold prefill
    mixed = _step(cache, [(0, 50), (2, 9)], [(1, 32, 38), (3, 0, 33)])
    assert torch.equal(mixed, torch.cat([cold[0][49:50], cold[2][8:9], cold[1][32:], cold[3]]))


def test_the_cache_layout_and_block_placement_change_no_bit() -> None:
    outs = [torch.cat(_cold(_cache(seed, heads_first))) for seed, heads_first in ((1, True), (2, True), (3, False))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert not outs[0].isnan().any()


def _dense(rows_of: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """The trainer's view of ``(sequence, position)`` rows: ``q``, keys/values ``[Hkv, S, L, D]`` (NaN past each
    sequence's end), sequence, positions."""
    length = max(LENGTHS)
    keys = torch.full((KV_HEADS, len(LENGTHS), length, DIM), float("nan"))
    values = keys.clone()
    for s, n in enumerate(LENGTHS):
        keys[:, s, :n], values[:, s, :n] = KEYS[s].transpose(0, 1), VALUES[s].transpose(0, 1)
    q = torch.stack([QUERIES[s][p] for s, p in rows_of])
    return q, keys, values, torch.tensor([s for s, _ in rows_of]), torch.tensor([p for _, p in rows_of])


def test_the_trainer_s_dense_entry_gives_the_engine_s_bits_with_gradients_on() -> None:
    rows_of = [(s, p) for s, n in enumerate(LENGTHS) for p in range(n)]
    q, keys, values, sequence, positions = _dense(rows_of)
    dense = attention(q.requires_grad_(), keys, values, sequence, positions, SCALE)
    assert torch.equal(dense.detach(), torch.cat(_cold(_cache(seed=4))))
    some = [rows_of[i] for i in (3, 60, 61, 130, 250)]  # a few rows of several sequences, out of order
    assert torch.equal(attention(*_dense(some), SCALE), dense.detach()[[3, 60, 61, 130, 250]])


def _plain(q, keys, values, sequence, positions) -> torch.Tensor:
    """Textbook softmax attention, one row at a time (float32)."""
    out = []
    for row, (s, p) in enumerate(zip(sequence.tolist(), positions.tolist())):
        k = keys[:, s, :p + 1].repeat_interleave(HEADS // KV_HEADS, 0)  # [Hq, p + 1, D]
        v = values[:, s, :p + 1].repeat_interleave(HEADS // KV_HEADS, 0)
        weights = torch.softmax(torch.einsum("hd,hkd->hk", q[row], k) * SCALE, -1)
        out.append(torch.einsum("hk,hkd->hd", weights, v))
    return torch.stack(out)


def test_close_to_plain_attention_and_differentiable_like_it() -> None:
    rows_of = [(s, p) for s, n in enumerate(LENGTHS) for p in range(0, n, 7)]
    q, keys, values, sequence, positions = _dense(rows_of)
    keys, values = keys.nan_to_num(0.0), values.nan_to_num(0.0)  # the plain form reads no NaN
    inputs = [t.clone().requires_grad_() for t in (q, keys, values)]
    plain_inputs = [t.clone().requires_grad_() for t in (q, keys, values)]
    out = attention(*inputs, sequence, positions, SCALE)
    plain = _plain(*plain_inputs, sequence, positions)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    grad = _randn(*out.shape, seed=5)
    out.backward(grad)
    plain.backward(grad)
    for mine, theirs in zip(inputs, plain_inputs):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def test_gemms_of_fewer_rows_change_a_decode_row_s_bits(monkeypatch) -> None:
    """The control: a decode row of one query head per KV head, in a GEMM of that one row (no tile), takes another
    path than a prefill's rows. (Two rows took the tile's path on a Sapphire Rapids CPU, one did not.)"""
    monkeypatch.setattr(sys.modules[__name__], "QUERIES", [q[:, ::2].contiguous() for q in QUERIES])
    cache = _cache(seed=1)
    cold = _cold(cache)
    monkeypatch.setattr(invariant, "_row_tile", 1)
    decoded = [_step(cache, [(s, n)], [])[0] for s, n in enumerate(LENGTHS)]
    assert any(not torch.equal(row, cold[s][-1]) for s, row in enumerate(decoded))


def test_a_padding_row_reads_nothing_and_leaves_the_others_alone() -> None:
    """A replayed graph's padding decode row (context 0) attends to nothing: zeros, and no other row changes."""
    cache = _cache(seed=1)
    cold = _cold(cache)
    k_cache, v_cache, table = cache
    rows = torch.cat([QUERIES[0][49:50], torch.zeros(1, HEADS, DIM), QUERIES[3][32:33]])
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=3, decode_block_tables=table[[0, 1, 3]],
        decode_context_lens=torch.tensor([50, 0, 33], dtype=torch.int32), prefill_block_tables=None,
        prefill_query_start_loc=None, prefill_context_lens=None)
    layer = PagedAttention(0, SCALE, torch.device("cpu"))
    layer.batch_invariant = True
    with torch.inference_mode():
        out = layer.attend(rows, ForwardContext(meta, [(k_cache, v_cache)]))
    assert torch.equal(out[0], cold[0][49]) and torch.equal(out[2], cold[3][32])
    assert not out[1].any()
