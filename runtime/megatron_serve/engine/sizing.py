"""What an engine is built with: its dtype, its context length and its KV pool (shared by every rank).

The engine (rank 0) and the tensor-parallel followers both size themselves here, so neither imports
the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import InferenceConfig
from .kv_cache import KVCachePool, blocks_for_tokens
from ..model.config import ModelConfig
from ..model.llama import LlamaForCausalLM
from ..model.parallel import TensorParallel

CPU_KV_BUDGET_BYTES = 1 << 30  # host memory is shared with everything else: a fixed budget, not "free memory"


def agree_on_min(value: int, tp: TensorParallel) -> int:
    """The smallest ``value`` over the group: every rank must size its KV pool identically."""
    if tp.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(tp.group) == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp.group)
    return int(tensor.item())


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


def build_kv_pool(model: LlamaForCausalLM, config: InferenceConfig, max_sequence_length: int,
                  device: torch.device) -> KVCachePool:
    """The KV pool, sized by ``num_kv_blocks`` or by memory; tensor-parallel ranks agree on the smallest."""
    mc = model.config
    dtype = model.dtype
    fp8 = config.kv_cache_dtype == "fp8"
    block_size = config.block_size_tokens
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        per_block = KVCachePool.bytes_per_block(mc.num_layers, block_size, model.num_local_kv_heads, mc.head_dim, dtype,
                                                fp8)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * config.kv_cache_memory_fraction) - (total - free)
        else:
            budget = int(CPU_KV_BUDGET_BYTES * config.kv_cache_memory_fraction)
        needed = config.max_requests * blocks_for_tokens(max_sequence_length, block_size)
        num_blocks = min(budget // per_block, needed)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: use a smaller model or raise kv_cache_memory_fraction")
    num_blocks = agree_on_min(num_blocks, model.tp)
    return KVCachePool(mc.num_layers, num_blocks, block_size, model.num_local_kv_heads, mc.head_dim, dtype, device,
                       fp8)
