"""The command lines of fleet processes started from Python: an ``InferenceConfig`` as engine flags.

``LocalFleet`` (and ``megatron-serve run`` through it) start real ``megatron-serve coordinator`` and
``megatron-serve engine`` processes; this module is what they need to build those commands, so that
the library never imports CLI code. :func:`inference_config_to_argv` is the inverse of
:func:`megatron_serve.commands.engine_options.inference_config_from_args` (a test checks the round
trip). Nothing heavy (the standard library, msgspec through ``wire.kv_events``): the coordinator and ``control``
do not import torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..wire.kv_events import json_object

if TYPE_CHECKING:  # importing config imports torch
    from ..config import InferenceConfig

#: The one ``kv_connector`` of ``--kv-transfer-config``: blocks travel through the coordinator's connections.
KV_CONNECTOR = "CoordinatorConnector"
#: vLLM's ``kv_role`` values: prefill, decode, and an engine that does both (colocated, the default).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def kv_transfer_config(text: str) -> str:
    """The ``kv_role`` of ``--kv-transfer-config`` (vLLM's JSON object: ``{"kv_connector": "CoordinatorConnector",
    "kv_role": "kv_producer"}``); ``ValueError`` naming the flag and the key for anything else."""
    config = json_object(text, "--kv-transfer-config")
    unknown = sorted(set(config) - {"kv_connector", "kv_role"})
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)} (known: kv_connector, kv_role)")
    connector = config.get("kv_connector", KV_CONNECTOR)
    if connector != KV_CONNECTOR:
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not available; {KV_CONNECTOR} sends "
                         "the KV blocks through the coordinator")
    role = config.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
    return role


def kv_role_argv(role: str) -> list[str]:
    """The engine flags of an engine playing ``role`` in a disaggregated fleet."""
    return ["--kv-transfer-config", json.dumps({"kv_connector": KV_CONNECTOR, "kv_role": role})]


def disaggregated_roles(num_engines: int, prefill_engines: int, decode_engines: int) -> list[str]:
    """Each engine's ``kv_role`` for ``--prefill-engines`` / ``--decode-engines`` (prefill first), or every engine
    ``kv_both`` without them; ``ValueError`` naming the option for a layout that cannot serve."""
    for name, count in (("--prefill-engines", prefill_engines), ("--decode-engines", decode_engines)):
        if count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    if not prefill_engines and not decode_engines:
        return ["kv_both"] * num_engines
    if not prefill_engines or not decode_engines:
        given, missing = (("--prefill-engines", "--decode-engines") if prefill_engines
                          else ("--decode-engines", "--prefill-engines"))
        raise ValueError(f"{given} needs {missing} >= 1: a disaggregated fleet has both kinds")
    if num_engines not in (1, prefill_engines + decode_engines):
        raise ValueError(f"--engines {num_engines} with --prefill-engines {prefill_engines} and --decode-engines "
                         f"{decode_engines}: the fleet's engines are the prefill and decode engines; leave --engines "
                         "out")
    return ["kv_producer"] * prefill_engines + ["kv_consumer"] * decode_engines

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
    "scheduling_policy": "scheduling_policy",
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
    "all2all_backend": "all2all_backend",
    "enable_eplb": "enable_eplb",
    "eplb_config": "eplb_config",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "pipeline_micro_batches": "pipeline_micro_batches",
    "kv_offloading_size": "kv_offloading_size",
    "kv_on_refit": "kv_on_refit",
    "kv_offloading_backend": "kv_offloading_backend",
    "kv_disk_dir": "kv_disk_dir",
    "kv_disk_size": "kv_disk_size",
    "kv_events_config": "kv_events_config",
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
        elif name == "kv_events_config":  # a KVEventsConfig, as vLLM's JSON object
            argv += [flag, value.to_json()]
        elif name in ("speculative", "eplb_config"):  # a SpeculativeConfig or EplbConfig, as vLLM's JSON object
            argv += [flag, json.dumps(asdict(value))]
        elif isinstance(value, dict):  # lora_modules: name -> path, in vLLM's JSON form (a name may hold "=")
            argv += [flag, *(json.dumps({"name": name, "path": path}) for name, path in value.items())]
        elif name == "dtype" and not isinstance(value, str):
            argv += [flag, str(value).removeprefix("torch.")]  # torch.bfloat16 -> bfloat16
        else:
            argv += [flag, str(value)]
    return argv
