"""Expert-parallel load balancing (EPLB): where each MoE layer's experts sit, and copies of the busy ones.

A router that favours a few experts leaves the ranks holding them doing most of a layer's work while the others wait
in the all-to-all. EPLB (DeepSeek-V3's redundant experts; vLLM's ``--enable-eplb``) gives a layer ``P = E + R``
*physical* experts over its ``ep`` ranks, ``P / ep`` slots each: every *logical* expert (the router's) has at least
one replica, busy ones several, and the replicas are packed onto the ranks so that each rank's share of the measured
load is about the mean. The router's choices go through a logical-to-physical map (:class:`LayerPlacement`), so the
rest of the model never sees a physical id: routing replay records logical ids, the checkpoint names logical experts.

The plan (:func:`plan_layer`) is computed from a window of measured loads, identically on every rank (plain integer
and float arithmetic on the host, ties broken by index), so the ranks agree on it without exchanging it:

1. *replicate*: each extra replica goes to the expert whose load per replica is highest (:func:`replicate`);
2. *pack*: replicas, heaviest first, into the rank with the least load that has a free slot, a rank not holding that
   expert yet first (:func:`pack`), so every rank ends with ``P / ep`` slots;
3. *hierarchical* (DeepSeek's policy where the group spans nodes and the experts come in groups, as DeepSeek-V3's
   group-limited routing): the groups are first packed onto nodes, then steps 1 and 2 run inside each node, so a
   token's experts stay on few nodes (:func:`plan_layer` with ``groups`` and ``nodes``).

*Balancedness* is the mean over the max of the tokens per rank (1.0: even), vLLM's metric.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

import torch


class StepBalancer(Protocol):
    """What the runner calls on a model's balancer (:class:`megatron_serve.engine.experts.balancer.ExpertBalancer`)."""

    def step(self) -> None:
        """The boundary before a forward, on every rank of the group."""

    def reset(self) -> None:
        """Forget the load counted so far (after warm-up and graph captures)."""

    def report(self, snapshot: dict) -> None:
        """Add its series to an engine's heartbeat ``metrics``."""

    def release(self) -> None:
        """Forget the group, broken or replaced, and any move under way on it."""

    def regroup(self, group: object) -> None:
        """Balance over ``group`` from the placements as they are now, every member together."""


def replicate(load: Sequence[float], num_physical: int) -> list[int]:
    """How many replicas each logical expert gets, ``num_physical`` in all (one each at least): each extra one goes to
    the expert with the highest load per replica (the lowest id among equals)."""
    experts = len(load)
    if num_physical < experts:
        raise ValueError(f"{num_physical} physical experts cannot hold {experts} logical ones")
    counts = [1] * experts
    heap = [(-float(load[e]), e) for e in range(experts)]
    heapq.heapify(heap)
    for _ in range(num_physical - experts):
        _, expert = heapq.heappop(heap)
        counts[expert] += 1
        heapq.heappush(heap, (-float(load[expert]) / counts[expert], expert))
    return counts


def pack(weights: Sequence[float], labels: Sequence[int], packs: int) -> list[int]:
    """Each item's pack, ``len(weights) / packs`` items in every pack: heaviest item first (lowest index among equals)
    into the pack with the least weight that has room, preferring packs holding no item of the same ``label`` (two
    replicas of one expert on one rank balance nothing)."""
    items = len(weights)
    if items % packs:
        raise ValueError(f"{items} items do not split into {packs} equal packs")
    room = items // packs
    loads, sizes, held = [0.0] * packs, [0] * packs, [set() for _ in range(packs)]
    where = [0] * items
    for item in sorted(range(items), key=lambda i: (-float(weights[i]), i)):
        label = labels[item]
        open_packs = [p for p in range(packs) if sizes[p] < room]
        chosen = min(open_packs, key=lambda p: (label in held[p], loads[p], p))
        where[item] = chosen
        loads[chosen] += float(weights[item])
        sizes[chosen] += 1
        held[chosen].add(label)
    return where


def _place(load: Sequence[float], experts: Sequence[int], num_physical: int, ranks: int) -> list[list[int]]:
    """``experts`` (logical ids) replicated to ``num_physical`` and packed onto ``ranks``: each rank's logical ids,
    ascending. The busiest experts' copies come in multiples the ranks may not divide (two experts taking all the
    load, six copies over four ranks: two ranks carry two); so the last few extra copies may go to the least busy
    experts instead, whichever of those packings is the most even (the first among equals)."""
    extra = num_physical - len(experts)
    best: tuple[float, list[list[int]]] | None = None
    for busy in range(extra, max(-1, extra - ranks), -1):
        counts = replicate([load[e] for e in experts], len(experts) + busy)
        idle = sorted(range(len(experts)), key=lambda i: (float(load[experts[i]]), i))
        for i in range(extra - busy):
            counts[idle[i % len(idle)]] += 1
        labels = [e for e, count in zip(experts, counts) for _ in range(count)]
        per_replica = {e: float(load[e]) / count for e, count in zip(experts, counts)}
        weights = [per_replica[e] for e in labels]
        where = pack(weights, labels, ranks)
        sums = [0.0] * ranks
        for weight, rank in zip(weights, where):
            sums[rank] += weight
        score = balancedness(sums)
        if best is None or score > best[0] + 1e-12:
            slots: list[list[int]] = [[] for _ in range(ranks)]
            for label, rank in zip(labels, where):
                slots[rank].append(label)
            best = (score, [sorted(rank) for rank in slots])
    return best[1]


def plan_layer(load: Sequence[float], num_physical: int, ranks: int, groups: int = 1, nodes: int = 1) -> list[int]:
    """The physical-to-logical map of one layer for its measured ``load`` (tokens per logical expert): physical expert
    ``p`` sits on rank ``p // (num_physical / ranks)``, and each rank's slots hold ascending logical ids.

    ``groups``/``nodes``: where ``nodes > 1`` and the ``E / groups`` expert groups split evenly over the nodes (and
    the ranks and physical experts too), the hierarchical policy; otherwise the global one."""
    experts = len(load)
    if num_physical % ranks:
        raise ValueError(f"{num_physical} physical experts do not split over {ranks} expert-parallel ranks")
    hierarchical = (nodes > 1 and experts % groups == 0 and groups % nodes == 0 and ranks % nodes == 0
                    and num_physical % nodes == 0)
    if not hierarchical:
        return [e for rank in _place(load, range(experts), num_physical, ranks) for e in rank]
    size = experts // groups
    group_load = [sum(float(load[e]) for e in range(g * size, (g + 1) * size)) for g in range(groups)]
    node_of = pack(group_load, list(range(groups)), nodes)
    plan: list[int] = []
    for node in range(nodes):
        members = [e for g in range(groups) if node_of[g] == node for e in range(g * size, (g + 1) * size)]
        plan += [e for rank in _place(load, members, num_physical // nodes, ranks // nodes) for e in rank]
    return plan


def rank_loads(load: Sequence[float], physical_to_logical: Sequence[int], ranks: int) -> list[float]:
    """Each rank's expected tokens: a logical expert's load split evenly over its replicas (tokens pick a replica
    in turn, :meth:`LayerPlacement.physical`)."""
    counts: dict[int, int] = {}
    for e in physical_to_logical:
        counts[e] = counts.get(e, 0) + 1
    per_rank = len(physical_to_logical) // ranks
    return [sum(float(load[e]) / counts[e] for e in physical_to_logical[r * per_rank:(r + 1) * per_rank])
            for r in range(ranks)]


def balancedness(per_rank: Sequence[float]) -> float:
    """Mean over max of the tokens per rank (1.0 where nothing ran)."""
    most = max(per_rank)
    return 1.0 if most <= 0 else sum(per_rank) / len(per_rank) / most


def identity_plan(num_experts: int, num_physical: int, ranks: int) -> list[int]:
    """The placement before any load is measured: rank ``r`` holds logical experts ``r * E/ep ..`` as without EPLB,
    and the redundant slots copies of experts in turn (``E % ep == 0`` assumed, as expert parallelism requires)."""
    own, extra = num_experts // ranks, (num_physical - num_experts) // ranks
    plan: list[int] = []
    for rank in range(ranks):
        copies = [(rank * extra + i + (rank + 1) * own) % num_experts for i in range(extra)]
        plan += list(range(rank * own, (rank + 1) * own)) + copies
    return plan


class LayerPlacement:
    """One MoE layer's logical-to-physical map as device data (CUDA graphs read it in place; :meth:`update` writes
    it between steps), and the layer's tokens per physical expert (:attr:`load`, which the balancer reads and zeroes
    each step: :mod:`megatron_serve.engine.experts.balancer`).

    ``replicas[e, i]``: the ``i``-th physical copy of logical expert ``e`` (``i < counts[e]``); at most
    ``1 + num_physical - num_experts`` copies."""

    def __init__(self, physical_to_logical: Sequence[int], num_experts: int, device: torch.device):
        self.num_experts = num_experts
        self.num_physical = len(physical_to_logical)
        most = 1 + self.num_physical - num_experts
        self.replicas = torch.zeros((num_experts, most), dtype=torch.int64, device=device)
        self.counts = torch.ones(num_experts, dtype=torch.int64, device=device)
        self.load = torch.zeros(self.num_physical, dtype=torch.int64, device=device)
        self.rotation = torch.zeros((), dtype=torch.int64, device=device)  # the balancer adds one each step
        self.physical_to_logical: list[int] = []
        self.update(physical_to_logical)

    def update(self, physical_to_logical: Sequence[int]) -> None:
        """Point the router's choices at a new placement (in place: a captured graph keeps reading it)."""
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for physical, logical in enumerate(physical_to_logical):
            table[logical].append(physical)
        if len(physical_to_logical) != self.num_physical or not all(table):
            raise ValueError(f"a placement of {len(physical_to_logical)} physical experts must hold each of "
                             f"{self.num_experts} logical experts at least once in {self.num_physical} slots")
        width = self.replicas.shape[1]
        padded = [row + [row[0]] * (width - len(row)) for row in table]
        self.replicas.copy_(torch.tensor(padded, dtype=torch.int64))
        self.counts.copy_(torch.tensor([len(row) for row in table], dtype=torch.int64))
        self.physical_to_logical = list(physical_to_logical)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """The physical expert each (token, logical expert) pair of ``ids [T, k]`` runs on, counted in :attr:`load`:
        token ``t``'s column ``j`` takes replica ``(t + j + rotation) mod count``, so a step's tokens spread over an
        expert's copies and successive steps of one token too. The choice depends on nothing but the pair's place and
        the step (replicas hold the same weights: a token's result does not depend on which ran it). No host
        synchronization."""
        tokens, columns = ids.shape
        flat = ids.reshape(-1).to(torch.int64)
        place = (torch.arange(tokens, device=flat.device)[:, None] + torch.arange(columns, device=flat.device)).reshape(-1)
        physical = self.replicas[flat, (place + self.rotation) % self.counts[flat]]
        self.load.index_add_(0, physical, torch.ones_like(physical))
        return physical.view(ids.shape)

    def logical_load(self, physical_load: torch.Tensor) -> torch.Tensor:
        """Tokens per logical expert from tokens per physical one (host tensors), under the current placement."""
        index = torch.tensor(self.physical_to_logical, dtype=torch.int64)
        return torch.zeros(self.num_experts, dtype=physical_load.dtype).index_add_(0, index, physical_load)
