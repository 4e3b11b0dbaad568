"""Data-parallel attention (``--data-parallel-size N --enable-expert-parallel``): N engines, one per data-parallel
rank, each with its own scheduler, KV cache and requests (the coordinator routes to each as to any engine), whose
attention runs on their own ``tensor_parallel_size`` ranks and whose MoE layers' experts are sharded over all
``N x tensor_parallel_size`` ranks (:class:`~megatron_serve.model.experts.token_dispatcher.DataParallelDispatcher`).

The MoE layers' all-to-alls span every data-parallel rank, so the engines step together, as vLLM's and SGLang's
data-parallel ranks do: before each step the leaders agree whether any of them has work (:func:`agree_turn`, one
all-reduce of two flags), and while one has, every engine steps; a step in which an engine ran no forward (nothing to
schedule, or only a step to read back) ends with an empty MoE pass on its ranks
(:func:`~megatron_serve.model.experts.moe.empty_moe_pass`): each MoE layer entered with no tokens, so the others'
tokens reach its experts and come back.

Each forward and each empty pass starts with one more all-reduce among the leaders: the largest token count of the
step (:func:`agree_tokens`, vLLM's ``num_tokens_across_dp``), which each leader sends its ranks with the step. Where a
step fits the CUDA graphs every rank pads to the same graph size (:meth:`..graphs.StepGraphs.padded_size`) and the
MoE layers use fixed-capacity buffers of that size (:mod:`megatron_serve.model.experts.capacity_dispatcher`): a rank whose
step a graph of that size covers replays it, the others (a step a graph does not cover, an idle rank's empty pass)
run eagerly with the same buffers, so each layer's all-to-alls have one shape everywhere whether captured or not.
Above the graphs, or without them, the ranks exchange exact counts; DeepEP's mode is picked from the same number.

The same turn carries a verb whose work is one collective over every rank of every engine (a trainer's refit: its
transfer group spans them all, :class:`.turns.HeldVerb`). Each engine's copy of the verb arrives on its own link, at
its own turn: an engine that acted on it at once would wait in the transfer for the others, while they wait in the
turn's all-reduce for it, until the transfer timed out. So each engine holds such a verb, and every one acts on it
at the first turn in which all of them hold theirs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..served import Turn


def agree_turn(leaders: object, busy: bool, holding: bool, change: bool = False) -> Turn:
    """Whether any data-parallel rank has work, whether every one holds a verb that joins them all, and whether one
    (the leader) saw a planned change asked for (every leader calls this once per turn of its step loop)."""
    flags = torch.tensor([int(busy), int(not holding), int(change)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=leaders)
    return Turn(bool(flags[0].item()), not flags[1].item(), bool(flags[2].item()))


def agree_tokens(leaders: object, tokens: int) -> int:
    """The largest of the data-parallel ranks' token counts this step (every leader calls this once per forward or
    empty pass, so the calls pair up as the MoE layers' collectives do)."""
    largest = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=leaders)
    return int(largest.item())
