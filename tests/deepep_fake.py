"""A stand-in for ``deep_ep`` on CPU: its V1 ``Buffer``'s documented semantics over torch.distributed (gloo), for
the tests of :mod:`megatron_serve.model.experts.deepep_dispatcher`. DeepEP's kernels need GPUs joined by NVLink or RDMA,
which this machine lacks; everything around them runs for real.

What DeepEP documents and this reproduces (``deep_ep/buffers/legacy.py``, ``tests/legacy``):

* normal mode: ``get_dispatch_layout`` counts; ``dispatch`` sends each token once to each rank holding one of its
  experts, received in source-rank order, its top-k ids made local (-1 for experts elsewhere), its weights beside;
  ``combine`` adds the rows each rank sends back for a token, without weights;
* low-latency mode: ``low_latency_dispatch`` gives ``[E/ep, ep x max_tokens, H]`` with the first ``count[e]`` rows
  of expert ``e`` used; ``low_latency_combine`` weighs each row by its token's router weight and adds them.

Each call is counted in :data:`Buffer.calls`, each buffer made in :data:`Buffer.made`.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

#: Group sizes DeepEP has tuned configurations for (``Buffer.get_dispatch_config`` asserts on others).
RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


class Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _exchange(group, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """``blocks[d]`` to rank ``d``; returns the block each rank sent here, in rank order (counts go first)."""
    sizes = torch.tensor([b.shape[0] for b in blocks], dtype=torch.int64)
    received = torch.empty_like(sizes)
    dist.all_to_all_single(received, sizes, group=group)
    send = torch.cat(blocks)
    out = send.new_empty((int(received.sum()), *send.shape[1:]))
    dist.all_to_all_single(out, send, received.tolist(), sizes.tolist(), group=group)
    return list(out.split(received.tolist()))


class Buffer:
    calls: Counter = Counter()
    made: list[tuple[int, int, bool]] = []

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, **_):
        self.group, self.ranks, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        Buffer.made.append((num_nvl_bytes, num_rdma_bytes, low_latency_mode))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config()

    get_combine_config = get_dispatch_config

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return max_tokens * hidden * num_ranks * 2 * 2

    def _owner(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        per = num_experts // self.ranks
        return torch.where(topk_idx >= 0, topk_idx // per, -1)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, **_):
        Buffer.calls["get_dispatch_layout"] += 1
        owner = self._owner(topk_idx, num_experts)
        in_rank = torch.stack([(owner == d).any(1) for d in range(self.ranks)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        Buffer.calls["dispatch"] += 1
        per = num_tokens_per_expert.numel() // self.ranks
        sent = [is_token_in_rank[:, d].nonzero().squeeze(1) for d in range(self.ranks)]
        local = [torch.where((topk_idx[t] >= d * per) & (topk_idx[t] < (d + 1) * per), topk_idx[t] - d * per, -1)
                 for d, t in enumerate(sent)]
        blocks = _exchange(self.group, [x[t] for t in sent])
        received_ids = torch.cat(_exchange(self.group, local))
        received_weights = torch.cat(_exchange(self.group, [topk_weights[t] for t in sent]))
        counts = [int((received_ids == e).sum()) for e in range(per)]
        handle = (sent, [b.shape[0] for b in blocks], x.shape[0])
        return torch.cat(blocks), received_ids, received_weights, counts, handle, None

    def combine(self, x, handle, topk_weights=None, **_):
        Buffer.calls["combine"] += 1
        sent, received, num_tokens = handle
        back = _exchange(self.group, list(x.split(received)))  # each rank's rows for the tokens sent it
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32)
        for tokens, rows in zip(sent, back):
            out.index_add_(0, tokens, rows.float())
        return out.to(x.dtype), None, None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True, **_):
        Buffer.calls["low_latency_dispatch"] += 1
        assert not use_fp8 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        per, slots = num_experts // self.ranks, num_max_dispatch_tokens_per_rank * self.ranks
        owner = self._owner(topk_idx, num_experts)
        pairs = [(owner == d).nonzero() for d in range(self.ranks)]  # (token, slot) pairs each rank gets
        rows = _exchange(self.group, [x[p[:, 0]] for p in pairs])
        experts = _exchange(self.group, [topk_idx[p[:, 0], p[:, 1]] - d * per for d, p in enumerate(pairs)])
        packed = x.new_zeros((per, slots, x.shape[1]))
        counts = torch.zeros(per, dtype=torch.int32)
        where = []  # for each source, each received pair's (expert, row) in the packed slabs
        for source_rows, source_experts in zip(rows, experts):
            spots = []
            for row, expert in zip(source_rows, source_experts.tolist()):
                packed[expert, counts[expert]] = row
                spots.append((expert, int(counts[expert])))
                counts[expert] += 1
            where.append(spots)
        return packed, counts, (pairs, where), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **_):
        Buffer.calls["low_latency_combine"] += 1
        pairs, where = handle
        back = _exchange(self.group, [torch.stack([x[e, s] for e, s in spots]) if spots
                                      else x.new_empty((0, x.shape[2])) for spots in where])
        out = torch.zeros((topk_idx.shape[0], x.shape[2]), dtype=torch.float32)
        for sent, rows in zip(pairs, back):
            weights = topk_weights[sent[:, 0], sent[:, 1]].float()
            out.index_add_(0, sent[:, 0], rows.float() * weights[:, None])
        return out.to(x.dtype), None, None
