"""Engine sizing options shared by every command that builds an engine (docs/reference/cli.md): the rows of
``flags.yaml``'s ``engine`` section, and what they make (:func:`inference_config_from_args`).

vLLM's names for these options (``--max-model-len``, ``--max-num-seqs`` ...) come from the one
table in :mod:`~megatron_serve.commands.aliases`; vLLM's other engine options (``--quantization``,
``--kv-cache-dtype``, ``--trust-remote-code`` ...) from :mod:`~megatron_serve.client.vllm_options`.
Nothing heavy is imported here: ``--help`` must not wait for torch (``InferenceConfig`` is imported
when the config is built).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..client.vllm_options import CHECKPOINT_QUANTIZATIONS, Scope, add_vllm_options
from .flags import add_flags

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..engine import DynamicInferenceEngine

#: vLLM's ``--dtype`` spellings of ours (``auto`` = the default: float32 on CPU, the checkpoint's on GPU).
DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    add_flags(parser.add_argument_group("engine"), "engine", DTYPE_NAMES=list(DTYPE_NAMES))
    add_vllm_options(parser, Scope.ENGINE)


def inference_config_from_args(args: argparse.Namespace, tensor_parallel_size: int = 1) -> "InferenceConfig":
    from ..config import InferenceConfig  # noqa: PLC0415 - torch: only once the command runs

    return InferenceConfig(
        dtype=DTYPE_NAMES[args.dtype], device=args.device, block_size_tokens=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_batch_tokens=args.max_batch_tokens, max_requests=args.max_requests,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_long_partial_prefills=args.max_long_partial_prefills, scheduling_policy=args.scheduling_policy,
        max_sequence_length=args.max_sequence_length, enable_prefix_caching=args.prefix_caching,
        enable_cuda_graphs=args.cuda_graphs, cuda_graph_sizes=args.cuda_graph_sizes,
        async_scheduling=args.async_scheduling, tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, all2all_backend=args.all2all_backend,
        enable_eplb=args.enable_eplb, eplb_config=args.eplb_config,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_micro_batches=args.pipeline_micro_batches,
        seed=args.seed,
        quantization=None if args.quantization in (None, *CHECKPOINT_QUANTIZATIONS) else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, verify_logprobs_fraction=args.verify_logprobs_fraction,
        logprobs_mode=args.logprobs_mode, trainer_tensor_parallel_size=args.trainer_tensor_parallel_size,
        **({} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}),
        enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        max_lora_versions=args.max_lora_versions, lora_push_dir=args.lora_push_dir,
        lora_allowed_dirs=args.lora_allowed_dirs,
        lora_modules=dict(args.lora_modules) if args.lora_modules else None,
        speculative=args.speculative_config, kv_offloading_size=args.kv_offloading_size,
        kv_on_refit=args.kv_on_refit, kv_events_config=args.kv_events_config,
        kv_offloading_backend=args.kv_offloading_backend, kv_disk_dir=args.kv_disk_dir,
        kv_disk_size=args.kv_disk_size,
    )


def capacity_line(engine: "DynamicInferenceEngine") -> str:
    """The start-up log's account of an engine's room: its KV pool, and how many requests of full length fit
    (vLLM's "maximum concurrency" line), against how many may run at once."""
    block = engine.config.block_size_tokens
    blocks = engine.allocator.num_blocks
    full = engine.max_sequence_length
    fit = blocks // -(-full // block)
    running = engine.config.max_requests
    line = (f"{blocks} KV blocks of {block} tokens ({blocks * block} tokens): {fit} request(s) of full length "
            f"({full} tokens) fit at once; up to {running} run at once")
    if fit < running:
        line += " (shorter ones share the pool; when it fills, the newest running request waits and is recomputed)"
    return line
