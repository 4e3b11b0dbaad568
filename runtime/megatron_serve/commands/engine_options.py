"""Engine sizing options shared by every command that builds an engine (DESIGN section 7).

vLLM's names for these options (``--max-model-len``, ``--max-num-seqs`` ...) come from the one
table in :mod:`~megatron_serve.commands.aliases`. Nothing heavy is imported here: ``--help`` must
not wait for torch (``InferenceConfig`` is imported when the config is built).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .aliases import add_option

if TYPE_CHECKING:
    from ..config import InferenceConfig

#: ``--quantization`` and ``--kv-cache-dtype`` values (as ``megatron_serve.config`` accepts them; no torch here).
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: vLLM's ``--dtype`` spellings of ours (``auto`` = the default: float32 on CPU, the checkpoint's on GPU).
DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", choices=list(DTYPE_NAMES), default="auto",
                       help="weights and KV cache dtype; auto = float32 on CPU, the checkpoint's on GPU")
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    group.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                       help="KV cache block size in tokens (default: 16 on CPU, 64 on GPU)")
    group.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                       help="KV pool size in blocks (default: sized by --kv-cache-memory-fraction)")
    add_option(group, "--kv-cache-memory-fraction", type=float, default=0.9, metavar="F",
               help="fraction of the device memory free after loading the weights that the KV pool takes "
                    "(on CPU: of a 1 GiB budget)")
    add_option(group, "--max-batch-tokens", type=int, default=2048, metavar="N", help="token budget of one step")
    add_option(group, "--max-requests", type=int, default=64, metavar="N", help="requests running at once")
    add_option(group, "--max-sequence-length", type=int, default=None, metavar="N",
               help="prompt + generation limit (default: the model's context length)")
    add_option(group, "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
               help="reuse KV blocks of shared prompt prefixes")
    add_option(group, "--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
               help="replay decode steps from CUDA graphs on a GPU (--no-cuda-graphs: always eager)")
    group.add_argument("--seed", type=int, default=0, help="seed of sampling without a per-request seed")
    group.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                       help="fp8: quantize a bf16 checkpoint's linear layers to FP8 at load (FP8 checkpoints are "
                            "served as FP8 without it)")
    group.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                       help="fp8: KV cache in e4m3 with a scale per token and head, about twice the tokens "
                            "(auto: the model dtype)")


def inference_config_from_args(args: argparse.Namespace, tensor_parallel_size: int = 1) -> "InferenceConfig":
    from ..config import InferenceConfig  # noqa: PLC0415 - torch: only once the command runs

    return InferenceConfig(
        dtype=DTYPE_NAMES[args.dtype], device=args.device, block_size_tokens=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_batch_tokens=args.max_batch_tokens, max_requests=args.max_requests,
        max_sequence_length=args.max_sequence_length, enable_prefix_caching=args.prefix_caching,
        enable_cuda_graphs=args.cuda_graphs, tensor_parallel_size=tensor_parallel_size, seed=args.seed,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )
