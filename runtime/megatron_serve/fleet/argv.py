"""The command lines of fleet processes started from Python: an ``InferenceConfig`` as engine flags.

``LocalFleet`` (and ``megatron-serve run`` through it) start real ``megatron-serve coordinator`` and
``megatron-serve engine`` processes; this module is what they need to build those commands, so that
the library never imports CLI code. :func:`inference_config_to_argv` is the inverse of
:func:`megatron_serve.commands.engine_options.inference_config_from_args` (a test checks the round
trip). The shared token travels in the environment (:data:`TOKEN_ENV`), never on a command line
where ``ps`` would show it. Standard library only: the coordinator and ``control`` do not import torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing config imports torch
    from ..config import InferenceConfig

TOKEN_ENV = "MEGATRON_SERVE_TOKEN"

# engine option (flag dest) -> InferenceConfig field
ENGINE_FIELDS = {
    "dtype": "dtype",
    "block_size": "block_size_tokens",
    "num_kv_blocks": "num_kv_blocks",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "max_batch_tokens": "max_batch_tokens",
    "max_requests": "max_requests",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "max_long_partial_prefills": "max_long_partial_prefills",
    "max_sequence_length": "max_sequence_length",
    "prefix_caching": "enable_prefix_caching",
    "cuda_graphs": "enable_cuda_graphs",
    "cuda_graph_sizes": "cuda_graph_sizes",
    "async_scheduling": "async_scheduling",
    "device": "device",
    "seed": "seed",
    "quantization": "quantization",
    "kv_cache_dtype": "kv_cache_dtype",
    "verify_logprobs_fraction": "verify_logprobs_fraction",
    "batch_invariant": "batch_invariant",
    "logprobs_mode": "logprobs_mode",
    "trainer_tensor_parallel_size": "trainer_tensor_parallel_size",
    "enable_lora": "enable_lora",
    "lora_modules": "lora_modules",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "max_cpu_loras": "max_cpu_loras",
    "max_lora_versions": "max_lora_versions",
    "lora_push_dir": "lora_push_dir",
    "lora_allowed_dirs": "lora_allowed_dirs",
    "speculative_config": "speculative",
    "enable_expert_parallel": "enable_expert_parallel",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "kv_offloading_size": "kv_offloading_size",
    "kv_on_refit": "kv_on_refit",
}


def inference_config_to_argv(config: "InferenceConfig | None") -> list[str]:
    """The engine flags that rebuild ``config`` in another process (none for ``None``)."""
    argv: list[str] = []
    if config is None:
        return argv
    for dest, name in ENGINE_FIELDS.items():
        value = getattr(config, name)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif name == "speculative":  # a SpeculativeConfig, as vLLM's JSON object
            argv += [flag, json.dumps(asdict(value))]
        elif isinstance(value, dict):  # lora_modules: name -> path, in vLLM's JSON form (a name may hold "=")
            argv += [flag, *(json.dumps({"name": name, "path": path}) for name, path in value.items())]
        elif name == "dtype" and not isinstance(value, str):
            argv += [flag, str(value).removeprefix("torch.")]  # torch.bfloat16 -> bfloat16
        else:
            argv += [flag, str(value)]
    return argv
