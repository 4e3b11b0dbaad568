"""Engine sizing options shared by every command that builds an engine (DESIGN section 7)."""

from __future__ import annotations

import argparse

from ..config import InferenceConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weights and KV cache dtype (default: float32 on CPU, the checkpoint's on GPU)")
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    group.add_argument("--block-size", type=int, default=None, help="KV cache block size in tokens")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    group.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    group.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--max-requests", type=int, default=64, help="requests running at once")
    group.add_argument("--max-sequence-length", type=int, default=None, help="prompt + generation limit")
    group.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of shared prompt prefixes")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="replay decode steps from CUDA graphs on a GPU (--no-cuda-graphs: always eager)")
    group.add_argument("--seed", type=int, default=0)


def inference_config_from_args(args: argparse.Namespace, tensor_parallel_size: int = 1) -> InferenceConfig:
    return InferenceConfig(
        dtype=args.dtype, device=args.device, block_size_tokens=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, max_batch_tokens=args.max_batch_tokens,
        max_requests=args.max_requests, max_sequence_length=args.max_sequence_length,
        enable_prefix_caching=args.prefix_caching, enable_cuda_graphs=args.cuda_graphs,
        tensor_parallel_size=tensor_parallel_size, seed=args.seed,
    )
