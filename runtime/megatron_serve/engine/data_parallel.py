"""Data-parallel attention (``--data-parallel-size N --enable-expert-parallel``): N engines, one per data-parallel
rank, each with its own scheduler, KV cache and requests (the coordinator routes to each as to any engine), whose
attention runs on their own ``tensor_parallel_size`` ranks and whose MoE layers' experts are sharded over all
``N x tensor_parallel_size`` ranks (:class:`~megatron_serve.model.token_dispatcher.DataParallelDispatcher`).

The MoE layers' all-to-alls span every data-parallel rank, so the engines step together, as vLLM's and SGLang's
data-parallel ranks do: before each step the leaders agree whether any of them has work (:func:`any_busy`, one
all-reduce of a flag), and while one has, every engine steps; a step in which an engine ran no forward (nothing to
schedule, or only a step to read back) ends with an empty MoE pass on its ranks (:func:`empty_moe_pass`): each MoE
layer entered with no tokens, so the others' tokens reach its experts and come back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.moe import SparseMoeBlock


def any_busy(leaders: object, busy: bool) -> bool:
    """Whether any data-parallel rank has work (every leader calls this once per turn of its step loop)."""
    flag = torch.tensor([int(busy)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=leaders)
    return bool(flag.item())


@torch.inference_mode()
def empty_moe_pass(model: torch.nn.Module) -> None:
    """Every MoE layer of ``model`` on no tokens, in layer order: the collectives a forward of this rank issues,
    with nothing of its own to send (attention and dense layers need no peer, so they are skipped)."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block(torch.empty((0, block.gate.weight.shape[1]), dtype=block.gate.weight.dtype,
                              device=block.gate.weight.device))
