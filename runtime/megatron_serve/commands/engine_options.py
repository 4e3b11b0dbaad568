"""Engine sizing options shared by every command that builds an engine (docs/reference/cli.md).

vLLM's names for these options (``--max-model-len``, ``--max-num-seqs`` ...) come from the one
table in :mod:`~megatron_serve.commands.aliases`; vLLM's other engine options (``--quantization``,
``--kv-cache-dtype``, ``--trust-remote-code`` ...) from :mod:`~megatron_serve.client.vllm_options`.
Nothing heavy is imported here: ``--help`` must not wait for torch (``InferenceConfig`` is imported
when the config is built).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..wire.lifecycle import KV_ON_REFIT
from ..wire.sampling_params import LOGPROBS_MODES
from .aliases import add_option
from ..client.vllm_options import CHECKPOINT_QUANTIZATIONS, Scope, add_vllm_options

if TYPE_CHECKING:
    from ..config import InferenceConfig
    from ..engine import DynamicInferenceEngine

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
    add_option(group, "--num-kv-blocks", type=int, default=None, metavar="N",
               help="KV pool size in blocks (default: sized by --kv-cache-memory-fraction)")
    add_option(group, "--kv-cache-memory-fraction", type=float, default=0.9, metavar="F",
               help="fraction of the device memory free after loading the weights that the KV pool takes "
                    "(on CPU: of a 1 GiB budget)")
    add_option(group, "--max-batch-tokens", type=int, default=2048, metavar="N", help="token budget of one step")
    add_option(group, "--max-requests", type=int, default=256, metavar="N",
               help="requests running at once (vLLM's default); the KV pool is sized for this many of full length "
                    "where memory allows, and the start-up log says how many fit")
    group.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                       help="a prompt with more than N tokens left to compute is long: each step gives decodes and "
                            "shorter prompts their share before more than N of its tokens, so that a small request "
                            "does not wait behind every chunk of long prompts that came first; what budget is left "
                            "then goes to the long prompts (vLLM's option; default: a quarter of --max-batch-tokens; "
                            "0: off, first come, first served)")
    group.add_argument("--max-long-partial-prefills", type=int, default=1, metavar="N",
                       help="long prompts (see --long-prefill-token-threshold) given a chunk before shorter ones in "
                            "each step; the others are passed over until the shorter ones had their share "
                            "(vLLM's option; default: %(default)s)")
    add_option(group, "--max-sequence-length", type=int, default=None, metavar="N",
               help="prompt + generation limit (default: the model's context length)")
    add_option(group, "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
               help="reuse KV blocks of shared prompt prefixes")
    add_option(group, "--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
               help="replay steps from CUDA graphs on a GPU: decode steps whole, mixed steps piecewise "
                    "(--no-cuda-graphs, vLLM's --enforce-eager: always eager)")
    group.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                       help="token counts to capture, with vLLM's meaning: one value N captures 1, 2, 4 and every "
                            "8 up to N; several values capture exactly those (default: up to "
                            "min(2 x --max-num-seqs, 512))")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="schedule and launch the next step while the current one runs (the host's work "
                            "overlaps the GPU's; --no-async-scheduling: one step at a time)")
    group.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="M",
                       help="with --pipeline-parallel-size: a step's requests in M micro-batches, a stage running "
                            "one while the stage before runs the next (default: as many as stages; 1: whole steps)")
    group.add_argument("--seed", type=int, default=0, help="seeds the seeds drawn for requests that give none")
    group.add_argument("--verify-logprobs-fraction", type=float, default=0.0, metavar="F",
                       help="score this fraction (0 to 1, chosen by a hash of the request id) of the finished requests "
                            "that reported log probs again as one prompt, compare bitwise with what was reported, and "
                            "count it (logprob_parity_checked_total, logprob_parity_mismatch_total; a mismatch is "
                            "logged as a WARNING); default 0: off")
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="a request's logits, log probs and tokens bitwise its own whatever else shares its steps, "
                            "and equal to a trainer's under megatron_serve.invariant (docs/batch-invariance.md; "
                            "default: the environment's VLLM_BATCH_INVARIANT, else off)")
    group.add_argument("--max-lora-versions", type=int, default=2, metavar="K",
                       help="versions of one LoRA adapter resident at once (RL: a trainer's push makes a new one; "
                            "requests admitted under an older one finish under it); a push beyond it is refused "
                            "until the older requests finish (default: %(default)s)")
    group.add_argument("--lora-push-dir", default=None, metavar="DIR",
                       help="also write each LoRA adapter version a trainer pushes to DIR/<name>/v<version> (a PEFT "
                            "directory on a volume every engine sees at this path): the coordinator then has engines "
                            "that register later (restarted, scaled up) load it (default: pushes reach only the "
                            "engines registered at the time)")
    group.add_argument("--lora-allowed-dirs", nargs="+", default=None, metavar="DIR",
                       help="the directories (and their subdirectories) under which a LoRA adapter loaded while "
                            "serving (/v1/load_lora_adapter, control load_lora) may be read; a path elsewhere is "
                            "refused without saying whether it exists (default: the directories holding the "
                            "--lora-modules adapters, or none without them)")
    group.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                       help="what reported log probs are taken from: the model's logits (raw) or those after logit "
                            "bias, penalties, grammar, temperature, min-p, top-k and top-p (processed); as log probs "
                            "or as logits")
    group.add_argument("--trainer-tensor-parallel-size", type=int, default=None, metavar="N",
                       help="the tensor-parallel size of the trainer that recomputes log probs under "
                            "megatron_serve.invariant: with --batch-invariant, an engine at another size warns at "
                            "start (each size splits the reductions its own way; default: not declared)")
    _add_kv_tier_options(group)
    add_vllm_options(parser, Scope.ENGINE)


def _add_kv_tier_options(group: argparse._ArgumentGroup) -> None:
    """The disk tier's place and size (``--kv-offloading-backend disk``, vLLM's flag, is among the vLLM options) and
    what a resume does with kept KV after a refit."""
    group.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                       help="with --kv-offloading-backend disk: the directory of the KV disk tier, shared by the "
                            "engines of a node (each reads the blocks the others wrote)")
    group.add_argument("--kv-disk-size", type=float, default=None, metavar="GIB",
                       help="with --kv-offloading-backend disk: the most the directory holds, every engine's files "
                            "together, in GiB (least recently used out first)")
    group.add_argument("--kv-on-refit", choices=KV_ON_REFIT, default="recompute",
                       help="what resume does with the KV that suspend --keep-kv kept when a refit came in between: "
                            "recompute each request's context under the new weights, or keep the old KV (the "
                            "tokens' kv_epochs say so) (default: %(default)s)")


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
