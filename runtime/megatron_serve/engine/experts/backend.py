"""``--all2all-backend``: which all-to-all an engine group's expert-parallel MoE layers run, chosen once at start on
every rank alike, and said in one log line (docs/parallelism.md).

``auto`` (the default) takes DeepEP where it can run (:func:`deepep_problem` finds nothing to stop it): in its
low-latency mode for steps up to the largest CUDA graph, normal mode above, as SGLang's ``--deepep-mode auto``
does; everywhere else the plain all-to-all (``alltoall``). A backend named explicitly that cannot run is refused at
start, saying why. What each backend does is :mod:`megatron_serve.model.experts.dispatch`'s.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from types import ModuleType
from typing import Callable

import torch
import torch.distributed

from ...config import InferenceConfig
from ...model.experts.deepep_dispatcher import LOW_LATENCY_HIDDEN, DeepEPBuffers, DeepEPDispatcher
from ...model.experts.dispatch import ExpertStep, install_dispatchers
from ...model.experts.moe import SparseMoeBlock
from ..precompile.graphs import capture_sizes
from .balancer import ExpertBalancer, place_experts

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")  # an MoE block's module name: its decoder layer


@functools.cache
def import_deep_ep() -> ModuleType:
    """``deep_ep``, imported once (its import checks the NCCL library and starts its JIT compiler)."""
    return importlib.import_module("deep_ep")


def low_latency_limit(config: InferenceConfig) -> int:
    """The largest step (tokens of the whole group's step, as each rank sees it) that DeepEP's low-latency mode
    serves: the largest CUDA graph's (``--cuda-graph-sizes``), within the step's token budget."""
    return min(max(capture_sizes(config.cuda_graph_sizes, config.max_requests)), config.max_batch_tokens)


def rank_tokens(limit: int, tensor_parallel_size: int) -> int:
    """A rank's largest low-latency dispatch (its chunk of a ``limit``-token step), a multiple of 4 as DeepEP's
    TMA copies want its buffers."""
    chunk = -(-limit // tensor_parallel_size)
    return -(-chunk // 4) * 4


def deepep_problem(backend: str, config: InferenceConfig, device: torch.device, dtype: torch.dtype,
                   hidden_size: int, expert_ranks: int, importer: Callable[[], ModuleType] = import_deep_ep
                   ) -> str | None:
    """Why DeepEP's ``backend`` (``deepep_high_throughput`` or ``deepep_low_latency``) cannot serve this engine
    (None: it can)."""
    if device.type != "cuda":
        return f"its kernels run on GPUs, not on {device.type}"
    if config.batch_invariant:
        return "--batch-invariant wants one rank's bits, and DeepEP adds a token's experts in its own order"
    if config.enable_lora:
        return "LoRA adapters on the experts need each received row's token, which DeepEP's layouts do not keep"
    if dtype != torch.bfloat16:
        return f"its kernels move bfloat16 activations, the model runs in {str(dtype).removeprefix('torch.')}"
    if backend == "deepep_low_latency" and hidden_size not in LOW_LATENCY_HIDDEN:
        return (f"its low-latency kernels are built for hidden sizes {', '.join(map(str, LOW_LATENCY_HIDDEN))}, "
                f"not {hidden_size}")
    try:
        deep_ep = importer()
    except Exception as exc:  # noqa: BLE001 - an import that fails in any way means the same: not here
        return f"deep_ep is not importable ({type(exc).__name__}: {exc})"
    try:
        deep_ep.Buffer.get_dispatch_config(expert_ranks)
    except Exception as exc:  # noqa: BLE001 - DeepEP asserts on group sizes it has no tuned config for
        return f"DeepEP has no configuration for {expert_ranks} ranks ({exc or type(exc).__name__})"
    return None


def resolve_backend(config: InferenceConfig, device: torch.device, dtype: torch.dtype, hidden_size: int,
                    expert_ranks: int, importer: Callable[[], ModuleType] = import_deep_ep) -> tuple[str, str]:
    """``(backend, why)`` for this engine: ``config.all2all_backend``, or what ``auto`` comes to. A DeepEP backend
    asked for by name that cannot run raises ValueError naming it and why."""
    requested = config.all2all_backend
    if requested in ("alltoall", "allgather_reducescatter"):
        return requested, "--all2all-backend"
    if requested == "auto":
        problem = deepep_problem("deepep_low_latency", config, device, dtype, hidden_size, expert_ranks, importer)
        if problem is None:
            return "deepep_low_latency", "auto: deep_ep imports on this GPU"
        return "alltoall", f"auto: no DeepEP, {problem}"
    problem = deepep_problem(requested, config, device, dtype, hidden_size, expert_ranks, importer)
    if problem is not None:
        raise ValueError(f"--all2all-backend {requested}: {problem}")
    return requested, "--all2all-backend"


def agree_on_backend(backend: str, why: str, group: object, device: torch.device) -> tuple[str, str]:
    """What ``auto`` came to, the same on every rank of the expert group: DeepEP only where every rank can run it (a
    rank that imports deep_ep beside one that cannot would otherwise wait in a dispatch the other never joins)."""
    able = torch.tensor([int(backend.startswith("deepep"))], device=device)
    torch.distributed.all_reduce(able, op=torch.distributed.ReduceOp.MIN, group=group)
    if backend.startswith("deepep") and not able.item():
        return "alltoall", f"auto: another rank of the group cannot run DeepEP ({why} here)"
    return backend, why


def install_balancer(blocks: list[SparseMoeBlock], config: InferenceConfig, group: object, device: torch.device,
                     layers: list[int]) -> ExpertBalancer:
    """EPLB over the expert-parallel group (``--enable-eplb``): the first placement with ``num_redundant_experts``
    copies, and the balancer the runner calls each step (``layers``: the blocks' decoder layers, which its metrics
    name). Its transfers get a group of their own (created by every rank of the group together, here), so that a
    move's all-to-all runs beside a step's."""
    eplb = config.eplb_config
    transfer_group = None  # a rank that joins a running group has none yet: its join gives the balancer its groups
    if torch.distributed.is_initialized():
        transfer_group = torch.distributed.new_group(torch.distributed.get_process_group_ranks(group))
    place_experts(blocks, eplb.num_redundant_experts, transfer_group)
    balancer = ExpertBalancer(blocks, eplb, group, transfer_group, blocks[0].tp.data_parallel.size > 1, device,
                              layers)
    if blocks[0].tp.expert_rank == 0:
        logger.info("EPLB: %d MoE layers, %d physical experts each over %d ranks (%d redundant); window %d steps, "
                    "rearranged every %d", len(blocks), blocks[0].experts.num_physical, blocks[0].tp.expert_size,
                    eplb.num_redundant_experts, eplb.window_size, eplb.step_interval)
    return balancer


def install_expert_backend(model: torch.nn.Module, config: InferenceConfig,
                           importer: Callable[[], ModuleType] = import_deep_ep) -> ExpertStep | None:
    """Resolve the backend and give every MoE layer of ``model`` its dispatchers (None, and nothing logged, where no
    MoE layer moves tokens between ranks); rank 0 of the expert-parallel group logs which backend runs."""
    named = [(name, m) for name, m in model.named_modules()
             if isinstance(m, SparseMoeBlock) and m.dispatcher is not None]
    if not named:
        return None
    blocks = [block for _, block in named]
    tp, device = model.tp, next(model.parameters()).device
    group = tp.data_parallel.group if tp.data_parallel.size > 1 else tp.group
    if config.enable_eplb:  # physical experts first: the dispatchers move tokens to them
        layers = [int(_LAYER.search(name)[1]) for name, _ in named]
        model.expert_balancer = install_balancer(blocks, config, group, device, layers)
    hidden, experts = model.config.hidden_size, blocks[0].experts.num_physical
    backend, why = resolve_backend(config, device, model.dtype, hidden, tp.expert_size, importer)
    if config.all2all_backend == "auto" and torch.distributed.is_initialized():  # a rank of a real group
        backend, why = agree_on_backend(backend, why, group, device)
    factory = None
    if backend.startswith("deepep"):
        limit = low_latency_limit(config) if backend == "deepep_low_latency" else 0
        buffers = DeepEPBuffers(importer(), group, hidden, experts, rank_tokens(max(limit, 1), tp.size))
        factory = lambda block, step: DeepEPDispatcher(block.tp, experts, buffers, step, limit)  # noqa: E731
    step = install_dispatchers(model, backend, factory)
    if tp.expert_rank == 0:
        low_latency = f", low-latency mode up to {low_latency_limit(config)} tokens a step" \
            if backend == "deepep_low_latency" else ""
        logger.info("expert parallelism over %d ranks: all-to-all backend %s (%s)%s", tp.expert_size, backend, why,
                    low_latency)
    return step
