"""The mixture-of-experts op: Triton against its reference, and the reference against a per-token loop.

Under ``TRITON_INTERPRET=1`` every program instance costs about 1.5 ms: the cases keep the token
counts small, which still covers experts that receive no token, top-k 1, 2 and 8, a single expert,
and more experts than (token, expert) pairs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_kernels import invariant, reference
from megatron_kernels import triton_ops as tri
from megatron_kernels.moe_weights import ExpertWeights
from megatron_kernels.triton_moe import align_by_expert

from tests.helpers import script_module

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _inputs(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype, seed: int,
            only_experts: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=g) / intermediate**0.5
    logits = torch.randn(tokens, experts, generator=g)
    if only_experts is not None:  # every other expert gets no token
        mask = torch.full((experts,), float("-inf"))
        mask[only_experts] = 0.0
        logits = logits + mask
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    moe = ExpertWeights(w13.to(DEVICE, dtype), w2.to(DEVICE, dtype))
    return x.to(DEVICE, dtype), moe, weights.to(DEVICE), ids.to(DEVICE)


def _per_token(x, moe, weights, ids):
    """The definition, one (token, expert) pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e < 0:  # no expert
                continue
            gate, up = F.linear(x[t].float(), moe.w13[e].float()).chunk(2)
            out[t] += weights[t, slot].float() * F.linear(F.silu(gate) * up, moe.w2[e].float())
    return out


CASES = [
    # tokens, hidden, intermediate, experts, top_k, experts that get tokens (None = any)
    (7, 64, 32, 4, 2, None),
    (5, 64, 48, 8, 1, [1, 6]),  # six experts idle, odd intermediate size
    (3, 32, 32, 16, 8, list(range(0, 16, 2))),  # top-8 over 16 experts, half of them idle
    (9, 48, 32, 1, 1, None),  # a single expert: a dense MLP
    (1, 64, 64, 8, 2, None),  # one decode token: more experts than pairs
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "hidden", "intermediate", "experts", "top_k", "only"), CASES)
def test_triton_matches_reference(tokens, hidden, intermediate, experts, top_k, only, dtype):
    x, moe, weights, ids = _inputs(tokens, hidden, intermediate, experts, top_k, dtype, seed=tokens + experts,
                                       only_experts=only)
    expected = reference.fused_moe(x, moe, weights, ids)
    actual = tri.fused_moe(x, moe, weights, ids)
    assert actual.shape == expected.shape == x.shape and actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOL[dtype])


@pytest.mark.parametrize(("tokens", "hidden", "intermediate", "experts", "top_k", "only"), CASES)
def test_reference_is_the_per_token_definition(tokens, hidden, intermediate, experts, top_k, only):
    x, moe, weights, ids = _inputs(tokens, hidden, intermediate, experts, top_k, torch.float32, seed=3,
                                       only_experts=only)
    torch.testing.assert_close(reference.fused_moe(x, moe, weights, ids), _per_token(x, moe, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_no_tokens():
    x, moe, weights, ids = _inputs(0, 32, 16, 4, 2, torch.float32, seed=0)
    assert tri.fused_moe(x, moe, weights, ids).shape == (0, 32)
    assert reference.fused_moe(x, moe, weights, ids).shape == (0, 32)


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_negative_id_is_no_expert_in_every_implementation(top_k):
    """The expert-parallel dispatchers fill their unused rows with id -1: such a pair adds nothing (a row of -1 ids
    only is zero), in the Triton kernel (blocks of their own, writing zeros), the reference and the invariant op,
    whatever the rows hold (NaN included)."""
    x, moe, weights, ids = _inputs(9, 32, 16, 4, top_k, torch.float32, seed=7)
    ids[[1, 4, 8]] = -1
    ids[6, 0] = -1  # with top-2 the row keeps one expert
    x[4] = float("nan")  # an unused row's content is never read
    expected = _per_token(x, moe, weights, ids)
    assert expected[[1, 8]].abs().sum() == 0 and (top_k == 1 or expected[6].abs().sum() > 0)
    for op in (tri.fused_moe, reference.fused_moe, invariant.fused_moe):
        got = op(x, moe, weights, ids).float()
        assert torch.equal(got[[1, 4, 8]], torch.zeros_like(got[[1, 4, 8]])), op.__module__
        torch.testing.assert_close(got, expected.nan_to_num(0.0), atol=1e-5, rtol=1e-5)


def test_every_implementation_rejects_weights_or_routing_that_do_not_fit():
    x, moe, weights, ids = _inputs(2, 32, 16, 4, 2, torch.float32, seed=0)
    for op in (tri.fused_moe, reference.fused_moe, invariant.fused_moe):
        with pytest.raises(ValueError, match="expert weights"):
            op(x, moe._replace(w2=moe.w2[:, :, :8]), weights, ids)
        with pytest.raises(ValueError, match="must both be"):
            op(x, moe, weights[:, :1], ids)


def test_align_by_expert_sorts_and_pads_every_pair_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3]], dtype=torch.int64)  # expert 2 idle; 3 has five pairs
    sorted_ids, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    blocks = sorted_ids.view(-1, 4)
    seen = []
    for block, expert in zip(blocks.tolist(), block_experts.tolist()):
        real = [i for i in block if i < pairs]
        if expert < 0:
            assert not real
            continue
        assert real and all(int(flat[i]) == expert for i in real)  # one expert per block
        seen.extend(real)
    assert sorted(seen) == list(range(pairs))  # every pair exactly once
    assert block_experts.tolist()[:4] == [0, 1, 3, 3]  # expert order, idle expert 2 takes no block
    dropped = torch.tensor([[-1, 2], [0, -1]])
    sorted_ids, block_experts = align_by_expert(dropped, num_experts=4, block_m=2)
    assert block_experts.tolist()[:3] == [0, 2, -2]  # the pairs of no expert last, in a block of their own
    assert sorted_ids.view(-1, 2)[2].tolist() == [0, 3]


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_moe.py"


def test_benchmark_runs_and_the_reference_equals_transformers_experts(monkeypatch, capsys):
    """``benchmarks/fused_moe.py`` checks every implementation against ``transformers``' experts before
    timing it: run tiny, it must print a row per token count (so it cannot rot unnoticed). Its ``main`` runs in this
    process, whose torch it shares: a process of its own spent nearly all its CPU importing torch and
    ``transformers``. Its folder goes on the path after everything else, as a script run from it has its siblings;
    its seed stays inside it (``fork_rng``)."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCHMARK.parent)])
    with torch.random.fork_rng(), script_module("fused_moe_benchmark", BENCHMARK) as benchmark:
        code = benchmark.main(["--hidden", "64", "--intermediate", "32", "--experts", "6", "--top-k", "2",
                               "--tokens", "1", "5", "--iters", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s.*\(\s*[\d.]+x\)", out, re.M)
    assert [int(tokens) for tokens in rows] == [1, 5], out
