"""What an engine is built with: its dtype, its context length and its KV pool (shared by every rank).

The engine (rank 0) and the tensor-parallel followers both size themselves here, so neither imports
the other.

On a GPU the KV pool takes ``kv_cache_memory_fraction`` of the device's memory, less what is in use once
the weights are loaded, less a reserve for what serving allocates later: a step's activations (the
largest eager step: ``max_batch_tokens`` rows through one layer, and the logits and sampler temporaries
of ``max_requests`` rows) and the CUDA graphs' memory pool (the largest captured step's temporaries and
the graphs' persistent buffers). Without the reserve the pool took all of it and the first long prefill
or the graph capture could run out of memory. The reserve is an estimate from the shapes; the engine
logs it beside what the capture really took.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..config import InferenceConfig
from .kv.cache import KVCachePool, blocks_for_tokens
from .step_plan import StepBuffers
from ..model.config import ModelConfig
from ..model.llama import LlamaForCausalLM
from ..model.parallel import TensorParallel

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30  # host memory is shared with everything else: a fixed budget, not "free memory"


def agree_on_min(value: int, tp: TensorParallel) -> int:
    """The smallest ``value`` over the group (every stage's ranks): every rank must size its KV pool identically."""
    if tp.size * tp.stage.size == 1:
        return value
    group = tp.group if tp.stage.size == 1 else tp.stage.group
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of the weights this rank holds (a tied weight once): what ``control status`` reports per rank."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def default_dtype(config: InferenceConfig, model_config: ModelConfig) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there); the checkpoint's dtype, else bfloat16, on a GPU."""
    if config.dtype is not None:
        return config.dtype
    if not str(config.device).startswith("cuda"):
        return torch.float32
    return {"float16": torch.float16, "float32": torch.float32}.get(model_config.torch_dtype or "", torch.bfloat16)


def max_sequence_length_for(model_config: ModelConfig, config: InferenceConfig) -> int:
    limit = model_config.max_context
    requested = config.max_sequence_length
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_sequence_length={requested} exceeds what the model attends over ({limit})")
    return requested


def activation_bytes(config: ModelConfig, tokens: int, element_size: int, tp_size: int) -> int:
    """Peak temporaries of ``tokens`` rows through one decoder layer (this rank's share of the sharded ones)."""
    mlp = config.intermediate_size
    if config.moe is not None:  # routed experts see top_k rows per token
        mlp = max(mlp, config.moe.top_k * config.moe.expert_intermediate_size)
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_row = 4 * config.hidden_size + (qkv + 3 * mlp + config.num_heads * config.head_dim) // tp_size
    return tokens * per_row * element_size


def serving_reserve_bytes(config: ModelConfig, inference: InferenceConfig, element_size: int, tp_size: int,
                          graph_tokens: int) -> int:
    """What serving allocates beyond weights and KV pool (see the module docstring): eager step activations,
    float32 logits with the sampler's temporaries (about four copies) for ``max_requests`` rows, and for
    CUDA graphs of up to ``graph_tokens`` rows their pool and persistent buffers."""
    eager = activation_bytes(config, inference.max_batch_tokens, element_size, tp_size)
    sampling = 4 * inference.max_requests * config.vocab_size * 4
    graphs = 0
    if graph_tokens:
        persistent = graph_tokens * (2 * config.num_heads * config.head_dim // tp_size + 3 * config.hidden_size)
        graphs = activation_bytes(config, graph_tokens, element_size, tp_size) + persistent * element_size
    return eager + sampling + graphs


def build_kv_pool(model: LlamaForCausalLM, config: InferenceConfig, max_sequence_length: int,
                  device: torch.device, graph_tokens: int = 0) -> KVCachePool:
    """The KV pool, sized by ``num_kv_blocks`` or by memory; tensor-parallel ranks agree on the smallest."""
    mc = model.config
    dtype = model.dtype
    fp8 = config.kv_cache_dtype == "fp8"
    block_size = config.block_size_tokens
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        per_block = KVCachePool.bytes_per_block(len(model.model.own), block_size, model.num_local_kv_heads,
                                                mc.head_dim, dtype, fp8)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            reserve = serving_reserve_bytes(mc, config, torch.empty((), dtype=dtype).element_size(), model.tp.size,
                                            graph_tokens)
            budget = int(total * config.kv_cache_memory_fraction) - (total - free) - reserve
            logger.info("KV pool budget: %.2f GiB (%.0f%% of %.1f GiB, less %.2f GiB in use and %.2f GiB reserved for "
                        "activations and CUDA graphs)", max(budget, 0) / 2**30, 100 * config.kv_cache_memory_fraction,
                        total / 2**30, (total - free) / 2**30, reserve / 2**30)
        else:
            budget = int(CPU_KV_BUDGET_BYTES * config.kv_cache_memory_fraction)
        needed = config.max_requests * blocks_for_tokens(max_sequence_length, block_size)
        num_blocks = min(budget // per_block, needed)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: use a smaller model or raise kv_cache_memory_fraction")
    num_blocks = agree_on_min(num_blocks, model.tp)
    own = model.model.own  # a pipeline stage's layers
    return KVCachePool(len(own), num_blocks, block_size, model.num_local_kv_heads, mc.head_dim, dtype, device,
                       fp8, heads_first=device.type == "cpu", first_layer=own.start)


def engine_buffers(config: InferenceConfig, max_sequence_length: int, device: torch.device) -> StepBuffers:
    """The persistent step buffers of an engine built with ``config`` (every rank sizes them alike)."""
    return StepBuffers(config.max_batch_tokens, config.max_requests,
                       blocks_for_tokens(max_sequence_length, config.block_size_tokens), device)
