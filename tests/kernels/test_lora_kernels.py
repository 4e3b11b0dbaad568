"""Batched LoRA shrink/expand: the Triton kernels (interpreted on CPU, compiled on a GPU) equal the reference
twin, and both equal the per-row definition ``y += (x @ A_slot^T) @ B_slot^T`` for a step mixing slots, ranks
and base rows."""

from __future__ import annotations

import pytest
import torch

from megatron_kernels import invariant_lora, reference_lora, triton_lora
from megatron_kernels.reference_lora import LoraBatch

SLOTS, RANK, K, N = 3, 8, 24, 40
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a compiled Triton kernel reads GPU memory only


def _case(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=g)
    a = torch.randn(SLOTS, RANK, K, generator=g)
    b = torch.randn(SLOTS, N, RANK, generator=g)
    a[1, 4:] = 0  # slot 1 holds a rank-4 adapter, zero-padded to the table's rank
    b[1, :, 4:] = 0
    indices = torch.tensor([(i % (SLOTS + 1)) - 1 for i in range(tokens)], dtype=torch.int64)  # -1, 0, 1, 2, ...
    return x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), indices.to(DEVICE)


def _batch(indices):
    return LoraBatch.of(indices.to(DEVICE), indices.cpu().numpy())


def _per_row(x, a, b, indices):
    y = torch.zeros(x.shape[0], N, device=DEVICE)
    for t, slot in enumerate(indices.tolist()):
        if slot >= 0:
            y[t] = (x[t] @ a[slot].T) @ b[slot].T
    return y


@pytest.mark.parametrize("module", [reference_lora, triton_lora], ids=["reference", "triton"])
@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_shrink_expand_match_per_row_definition(module, tokens):
    x, a, b, indices = _case(tokens)
    y = torch.zeros(tokens, N, device=DEVICE)
    module.lora_expand(y, module.lora_shrink(x, a, _batch(indices)), b, _batch(indices))
    torch.testing.assert_close(y, _per_row(x, a, b, indices), rtol=1e-4, atol=1e-4)
    base = indices < 0
    assert bool(base.any()) and torch.equal(y[base], torch.zeros_like(y[base])), "base rows get no delta"


def test_triton_equals_reference_on_half_of_a_fused_output():
    """Expand adds into a strided view's rows (the qkv output) and leaves the other columns alone."""
    x, a, b, indices = _case(9, seed=1)
    y_ref = torch.randn(9, N + 8).to(DEVICE)
    y_tri = y_ref.clone()
    batch = _batch(indices)
    reference_lora.lora_expand(y_ref[:, :N], reference_lora.lora_shrink(x, a, batch), b, batch)
    triton_lora.lora_expand(y_tri[:, :N], triton_lora.lora_shrink(x, a, batch), b, batch)
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", [reference_lora, triton_lora], ids=["reference", "triton"])
def test_a_step_of_one_adapter_and_a_step_of_none(module):
    """Every row under slot 2 (the reference's one-slice path); and no adapter row at all (no delta)."""
    x, a, b, _ = _case(5, seed=2)
    for slot in (2, -1):
        indices = torch.full((5,), slot, dtype=torch.int64, device=DEVICE)
        y = torch.zeros(5, N, device=DEVICE)
        module.lora_expand(y, module.lora_shrink(x, a, _batch(indices)), b, _batch(indices))
        torch.testing.assert_close(y, _per_row(x, a, b, indices), rtol=1e-4, atol=1e-4)
    one = _batch(torch.full((5,), 2, dtype=torch.int64))
    assert (one.runs, one.sizes) == ((2,), (5,))


def test_batch_groups_rows_by_slot():
    batch = _batch(torch.tensor([1, -1, 0, 1, 0, -1], dtype=torch.int64))
    assert batch.order.tolist() == [2, 4, 0, 3] and batch.segments == ((0, 0, 2), (1, 2, 4))
    assert batch.runs == (1, -1, 0, 1, 0, -1) and batch.sizes == (1,) * 6  # the reference's slices: one row each
    grouped = _batch(torch.tensor([-1, -1, 0, 0, 0, 2, 0], dtype=torch.int64))  # as the engine orders a step
    assert grouped.runs == (-1, 0, 2, 0) and grouped.sizes == (2, 3, 1, 1)


@pytest.mark.parametrize("module", [reference_lora, triton_lora, invariant_lora],
                         ids=["reference", "triton", "invariant"])
def test_expand_block_by_block_equals_the_block_diagonal_whole(module):
    """A fused projection's hook expands part by part (its output columns, its ranks, its block of B): the same
    delta as the whole block-diagonal B, whose zero blocks it skips; the rows grouped by slot or not."""
    x, a, _, indices = _case(12, seed=3)
    g = torch.Generator().manual_seed(4)
    halves = (N // 4, N - N // 4)  # two parts, as gate|up
    b = torch.zeros(SLOTS, N, 2 * RANK, device=DEVICE)
    b[:, : halves[0], :RANK] = torch.randn(SLOTS, halves[0], RANK, generator=g)
    b[:, halves[0] :, RANK:] = torch.randn(SLOTS, halves[1], RANK, generator=g)
    a2 = torch.cat([a, torch.randn(SLOTS, RANK, K, generator=g).to(DEVICE)], dim=1)
    for rows in (indices, indices.sort(stable=True).values):
        batch = _batch(rows)
        whole, blocks = torch.zeros(12, N, device=DEVICE), torch.zeros(12, N, device=DEVICE)
        module.lora_expand(whole, module.lora_shrink(x, a2, batch), b, batch)
        h = module.lora_shrink(x, a2, batch)
        for part, (columns, ranks) in enumerate(((slice(0, halves[0]), slice(0, RANK)),
                                                  (slice(halves[0], N), slice(RANK, 2 * RANK)))):
            module.lora_expand(blocks[:, columns], h[:, ranks], b[:, columns, ranks], batch)
        torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
        assert torch.equal(blocks[rows < 0], torch.zeros_like(blocks[rows < 0]))


@pytest.mark.parametrize("module", [reference_lora, triton_lora, invariant_lora],
                         ids=["reference", "triton", "invariant"])
def test_weight_tables_stored_transposed_give_the_same_delta(module):
    """The slot tables as the model stores them: ``[slots, in, rank]`` and ``[slots, rank, out]`` memory, passed as
    transposed views in the kernels' layout; the delta is the contiguous tables'."""
    x, a, b, indices = _case(10, seed=5)
    stored_a, stored_b = a.transpose(1, 2).contiguous().transpose(1, 2), b.transpose(1, 2).contiguous().transpose(1, 2)
    assert stored_a.stride(-1) != 1 and stored_b.stride(-1) != 1
    batch = _batch(indices)
    y, y_stored = torch.zeros(10, N, device=DEVICE), torch.zeros(10, N, device=DEVICE)
    module.lora_expand(y, module.lora_shrink(x, a, batch), b, batch)
    module.lora_expand(y_stored, module.lora_shrink(x, stored_a, batch), stored_b, batch)
    torch.testing.assert_close(y_stored, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_stored, _per_row(x, a, b, indices), rtol=1e-4, atol=1e-4)
